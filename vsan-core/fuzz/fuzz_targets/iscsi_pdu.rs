//! A mode byte and bytes an initiator sends, decoded as iSCSI PDUs and re-encoded: see
//! `vsan_core::export::iscsi::fuzzing::check_pdu`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    vsan_core::export::iscsi::fuzzing::check_pdu(data);
});
