//! Messages chosen by the input, encoded and decoded: see
//! `vsan_replica_fuzz::check_roundtrip`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| vsan_replica_fuzz::check_roundtrip(data));
