//! Arbitrary bytes as the stream a peer sends: see `vsan_replica_fuzz::check_stream`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| vsan_replica_fuzz::check_stream(data));
