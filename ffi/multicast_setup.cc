// Multicast set-up arithmetic and the C++ side of the guard (no CUDA needed).
#include "multicast.h"
