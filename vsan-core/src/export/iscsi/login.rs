//! TEMP STUB (lead's scratch tree only)
#![allow(missing_docs, dead_code)]
use std::sync::Arc;
use super::pdu::{LoginReq, LoginResp};
#[derive(Clone, Debug)]
pub struct LoginTarget { pub name: String, pub alias: Option<String>, pub chap: Option<super::Chap> }
#[derive(Clone, Debug, Default)]
pub struct Limits { pub max_recv_data_segment_length: u32, pub max_burst_length: u32, pub first_burst_length: u32, pub max_outstanding_r2t: u32 }
#[derive(Debug)]
pub struct LoginConfig { pub targets: Vec<LoginTarget>, pub portal_group_tag: u16, pub limits: Limits }
pub struct Login;
impl Login { pub fn new(_c: Arc<LoginConfig>, _t: u16) -> Login { Login } pub fn step(&mut self, _r: &LoginReq) -> LoginStep { loop {} } }
pub enum LoginStep { Continue(LoginResp), Done(LoginResp, Negotiated), Refuse(LoginResp) }
#[derive(Debug, Clone)]
pub enum SessionKind { Discovery, Normal { target: usize } }
pub struct Negotiated { pub kind: SessionKind, pub initiator_name: String, pub initiator_alias: Option<String>, pub isid: [u8; 6], pub tsih: u16, pub cid: u16, pub params: SessionParams }
#[derive(Clone, Copy, Debug)]
pub struct SessionParams { pub header_digest: bool, pub data_digest: bool, pub max_recv_data_segment_length: u32, pub max_xmit_data_segment_length: u32, pub max_burst_length: u32, pub first_burst_length: u32, pub initial_r2t: bool, pub immediate_data: bool, pub max_outstanding_r2t: u32, pub data_pdu_in_order: bool, pub data_sequence_in_order: bool, pub default_time2wait: u16, pub default_time2retain: u16, pub error_recovery_level: u8, pub max_connections: u16 }
