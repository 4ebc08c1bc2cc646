//! Login Requests an initiator sends, driving one iSCSI login negotiation: see
//! `vsan_core::export::iscsi::fuzzing::check_login`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    vsan_core::export::iscsi::fuzzing::check_login(data);
});
