//! What a client sends after the NBD greeting (flags, options, then requests if an option
//! attaches), served by the real server: see `vsan_core::fuzzing::check_handshake`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    vsan_core::fuzzing::check_handshake(data);
});
