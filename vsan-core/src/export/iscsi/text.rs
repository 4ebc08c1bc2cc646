//! TEMP STUB
#![allow(missing_docs)]
pub fn respond(_c: &super::login::LoginConfig, _k: &super::login::SessionKind, _p: &str, _r: &[u8]) -> Result<bytes::Bytes, String> { Err(String::new()) }
