// The completion callback handed to the library: it forwards to the exported Go
// function. It lives in a .c file because a Go file with //export may hold only
// declarations in its preamble.
#include <stdint.h>

#include "vsan.h"
#include "_cgo_export.h"

void vsango_complete(void *userdata, vsan_result result, uint64_t tag) {
    // userdata is a cgo.Handle (a number), never a Go pointer.
    vsanGoComplete((uintptr_t)userdata, result, tag);
}
