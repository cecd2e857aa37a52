// NVLink multicast (redundant pull): set-up arithmetic, the guard, and the
// CUDA entry points.  Owned by the multicast work (issue 5).
#pragma once
