// The payload element types every backend supports, in the one order that
// the kernel tables and the multicast kernels index.
#pragma once

namespace sifar {

enum ElemType : int { kElemF32 = 0, kElemBf16 = 1, kElemF16 = 2, kNumElemTypes = 3 };

}  // namespace sifar
