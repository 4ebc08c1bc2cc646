//! A mode byte and the transmission phase (request headers and write payloads) after a
//! valid attach, served by the real server: see `vsan_core::fuzzing::check_request`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    vsan_core::fuzzing::check_request(data);
});
