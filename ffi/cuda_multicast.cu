// Multicast communicator set-up and the multimem.ld_reduce kernel.
#include "multicast.h"
