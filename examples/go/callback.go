package vsan

// This file holds the one exported (C-callable) function; cgo allows only
// declarations in the preamble of such a file.

/*
#include <stdint.h>
#include "vsan.h"
*/
import "C"

import "runtime/cgo"

// vsanGoComplete is the completion of an asynchronous I/O, called by vsango_complete
// (complete.c) exactly once per accepted submission: on a library thread, or on the
// submitting thread inside the submit call. It must not block: it copies a read's
// data, frees its C buffer, and sends on a channel with room for the result.
//
//export vsanGoComplete
func vsanGoComplete(h C.uintptr_t, result C.vsan_result, tag C.uint64_t) {
	handle := cgo.Handle(h)
	r := handle.Value().(*request)
	handle.Delete()
	var err error
	if result != C.VSAN_OK {
		// This is the thread the library calls back on: its message is the I/O's.
		err = &Error{Op: r.op, Code: Result(result), Message: lastMessage()}
	}
	r.finish(err)
}
