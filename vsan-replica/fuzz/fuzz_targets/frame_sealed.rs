//! One frame's kind, meta and data behind a correct header and crc: see
//! `vsan_replica_fuzz::check_sealed`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| vsan_replica_fuzz::check_sealed(data));
