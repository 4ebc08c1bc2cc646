//! Server side of fixed newstyle negotiation: greet, answer options, pick an export.
//!
//! Anything that does not parse (bad magic, an unknown client flag, a length that cannot
//! be true) ends the connection; a well-formed but unsupported option gets
//! `NBD_REP_ERR_UNSUP` and negotiation goes on, as the spec asks.

use std::sync::Arc;

use bytes::{BufMut, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use super::proto::*;
use super::server::Export;
use crate::error::{Error, ErrorKind, Result};

/// Options longer than this are answered with `NBD_REP_ERR_TOO_BIG` (a name is at most
/// 4096 bytes, and no option we support needs more than a name and a few info requests).
const MAX_OPTION_LEN: u32 = 16 << 10;
/// Options longer than this are not even read: the client is not speaking NBD.
const MAX_DISCARD_LEN: u32 = 1 << 20;

/// What negotiation ended with.
pub(crate) enum Outcome {
    /// Transmission starts on this export.
    Transmit(Arc<Export>),
    /// The client aborted or negotiation failed in a way that ends the connection.
    Closed,
}

/// A client that hangs up mid-negotiation has simply gone away (port probes do this).
fn read_err(what: &str, e: std::io::Error) -> Error {
    if e.kind() == std::io::ErrorKind::UnexpectedEof {
        Error::with_source(ErrorKind::Closed, what, e)
    } else {
        Error::io(what, e)
    }
}

fn proto_err(msg: impl Into<String>) -> Error {
    Error::new(ErrorKind::Protocol, msg)
}

async fn send_reply<S: AsyncWrite + Unpin>(
    s: &mut S,
    opt: u32,
    kind: u32,
    data: &[u8],
) -> Result<()> {
    let mut b = BytesMut::with_capacity(20 + data.len());
    b.put_u64(REPLY_MAGIC_OPT);
    b.put_u32(opt);
    b.put_u32(kind);
    b.put_u32(data.len() as u32);
    b.put_slice(data);
    s.write_all(&b)
        .await
        .map_err(|e| Error::io("send option reply", e))
}

async fn send_info<S: AsyncWrite + Unpin>(
    s: &mut S,
    opt: u32,
    info: u16,
    data: &[u8],
) -> Result<()> {
    let mut b = Vec::with_capacity(2 + data.len());
    b.extend_from_slice(&info.to_be_bytes());
    b.extend_from_slice(data);
    send_reply(s, opt, REP_INFO, &b).await
}

/// Read exactly `buf.len()` bytes, unless the server shuts down while waiting for them
/// (`Ok(false)`): a client idle in negotiation must not hold up a shutdown. Bytes the
/// client already sent are read first, so an option sent just before the shutdown still
/// gets its `NBD_REP_ERR_SHUTDOWN` answer.
async fn read_or_cancel<S: AsyncRead + Unpin>(
    s: &mut S,
    buf: &mut [u8],
    cancel: &CancellationToken,
    what: &str,
) -> Result<bool> {
    tokio::select! {
        biased;
        r = s.read_exact(buf) => r.map(|_| true).map_err(|e| read_err(what, e)),
        _ = cancel.cancelled() => Ok(false),
    }
}

/// Run negotiation on `s` against `exports`. Once `cancel` fires, options are refused
/// with `NBD_REP_ERR_SHUTDOWN` and a waiting client is let go.
pub(crate) async fn negotiate<S>(
    s: &mut S,
    exports: &[Arc<Export>],
    cancel: &CancellationToken,
) -> Result<Outcome>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut greet = BytesMut::with_capacity(18);
    greet.put_u64(NBDMAGIC);
    greet.put_u64(IHAVEOPT);
    greet.put_u16(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
    s.write_all(&greet)
        .await
        .map_err(|e| Error::io("send greeting", e))?;

    let mut flags = [0u8; 4];
    if !read_or_cancel(s, &mut flags, cancel, "read client flags").await? {
        return Ok(Outcome::Closed);
    }
    let client_flags = u32::from_be_bytes(flags);
    if client_flags & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
        return Err(proto_err(format!("unknown client flags {client_flags:#x}")));
    }
    let no_zeroes = client_flags & FLAG_C_NO_ZEROES != 0;

    loop {
        let mut head = [0u8; 16];
        if !read_or_cancel(s, &mut head, cancel, "read option header").await? {
            return Ok(Outcome::Closed);
        }
        let magic = u64::from_be_bytes(head[0..8].try_into().unwrap_or_default());
        let opt = u32::from_be_bytes(head[8..12].try_into().unwrap_or_default());
        let len = u32::from_be_bytes(head[12..16].try_into().unwrap_or_default());
        if magic != IHAVEOPT {
            return Err(proto_err(format!("bad option magic {magic:#x}")));
        }
        if len > MAX_DISCARD_LEN {
            return Err(proto_err(format!("option {opt} with absurd length {len}")));
        }
        let mut data = vec![0u8; len as usize];
        if !read_or_cancel(s, &mut data, cancel, "read option data").await? {
            return Ok(Outcome::Closed);
        }
        let shutting_down = cancel.is_cancelled();
        if len > MAX_OPTION_LEN {
            if opt == OPT_EXPORT_NAME {
                // No option reply may answer EXPORT_NAME (the client reads the export
                // size next): the spec says close.
                return Err(proto_err(format!("export name of {len} bytes")));
            }
            send_reply(s, opt, REP_ERR_TOO_BIG, b"option too long").await?;
            continue;
        }

        match opt {
            OPT_EXPORT_NAME => {
                let name =
                    String::from_utf8(data).map_err(|_| proto_err("export name is not UTF-8"))?;
                // EXPORT_NAME has no way to report an error: the spec says close.
                let Some(export) = find(exports, &name) else {
                    return Err(Error::new(
                        ErrorKind::NotFound,
                        format!("no export named {name:?}"),
                    ));
                };
                if shutting_down {
                    return Ok(Outcome::Closed);
                }
                let mut b = BytesMut::with_capacity(10 + 124);
                b.put_u64(export.size());
                b.put_u16(export.transmission_flags());
                if !no_zeroes {
                    b.put_bytes(0, 124);
                }
                s.write_all(&b)
                    .await
                    .map_err(|e| Error::io("send export info", e))?;
                return Ok(Outcome::Transmit(export));
            }
            OPT_ABORT => {
                // Best effort: the client may already be gone.
                let _ = send_reply(s, opt, REP_ACK, &[]).await;
                return Ok(Outcome::Closed);
            }
            OPT_LIST => {
                if !data.is_empty() {
                    send_reply(s, opt, REP_ERR_INVALID, b"LIST takes no data").await?;
                    continue;
                }
                for e in exports {
                    let mut b = Vec::new();
                    b.extend_from_slice(&(e.name().len() as u32).to_be_bytes());
                    b.extend_from_slice(e.name().as_bytes());
                    b.extend_from_slice(e.description().as_bytes());
                    send_reply(s, opt, REP_SERVER, &b).await?;
                }
                send_reply(s, opt, REP_ACK, &[]).await?;
            }
            OPT_INFO | OPT_GO => {
                let Some((name, requests)) = parse_info_request(&data) else {
                    send_reply(s, opt, REP_ERR_INVALID, b"malformed INFO/GO request").await?;
                    continue;
                };
                let Some(export) = find(exports, &name) else {
                    let msg = format!("no export named {name:?}");
                    send_reply(s, opt, REP_ERR_UNKNOWN, msg.as_bytes()).await?;
                    continue;
                };
                if shutting_down {
                    send_reply(s, opt, REP_ERR_SHUTDOWN, b"server shutting down").await?;
                    continue;
                }
                let mut info = Vec::with_capacity(10);
                info.extend_from_slice(&export.size().to_be_bytes());
                info.extend_from_slice(&export.transmission_flags().to_be_bytes());
                send_info(s, opt, INFO_EXPORT, &info).await?;
                if requests.contains(&INFO_NAME) {
                    send_info(s, opt, INFO_NAME, export.name().as_bytes()).await?;
                }
                if requests.contains(&INFO_DESCRIPTION) && !export.description().is_empty() {
                    send_info(s, opt, INFO_DESCRIPTION, export.description().as_bytes()).await?;
                }
                // Always sent: clients ignore info they did not ask for, and those that
                // honour it avoid misaligned requests.
                let (min, pref, max) = export.block_sizes();
                let mut bs = Vec::with_capacity(12);
                bs.extend_from_slice(&min.to_be_bytes());
                bs.extend_from_slice(&pref.to_be_bytes());
                bs.extend_from_slice(&max.to_be_bytes());
                send_info(s, opt, INFO_BLOCK_SIZE, &bs).await?;
                send_reply(s, opt, REP_ACK, &[]).await?;
                if opt == OPT_GO {
                    return Ok(Outcome::Transmit(export));
                }
            }
            _ => {
                send_reply(s, opt, REP_ERR_UNSUP, b"option not supported").await?;
            }
        }
    }
}

fn find(exports: &[Arc<Export>], name: &str) -> Option<Arc<Export>> {
    if name.is_empty() && exports.len() == 1 {
        return exports.first().cloned();
    }
    exports.iter().find(|e| e.name() == name).cloned()
}

/// Parse INFO/GO data: u32 name length, name, u16 count, count x u16 info types. Every
/// length must add up exactly.
fn parse_info_request(data: &[u8]) -> Option<(String, Vec<u16>)> {
    let name_len = u32::from_be_bytes(data.get(0..4)?.try_into().ok()?) as usize;
    let name_end = 4usize.checked_add(name_len)?;
    let name = std::str::from_utf8(data.get(4..name_end)?).ok()?.to_owned();
    let count = u16::from_be_bytes(data.get(name_end..name_end + 2)?.try_into().ok()?) as usize;
    let reqs = data.get(name_end + 2..)?;
    if reqs.len() != count * 2 {
        return None;
    }
    Some((
        name,
        reqs.chunks_exact(2)
            .map(|c| u16::from_be_bytes([c[0], c[1]]))
            .collect(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn info_request_lengths_must_add_up() {
        let mut ok = Vec::new();
        ok.extend_from_slice(&3u32.to_be_bytes());
        ok.extend_from_slice(b"vol");
        ok.extend_from_slice(&1u16.to_be_bytes());
        ok.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
        assert_eq!(
            parse_info_request(&ok),
            Some(("vol".into(), vec![INFO_BLOCK_SIZE]))
        );
        assert_eq!(parse_info_request(&ok[..ok.len() - 1]), None);
        let mut long_name = ok.clone();
        long_name[0..4].copy_from_slice(&u32::MAX.to_be_bytes());
        assert_eq!(parse_info_request(&long_name), None);
        assert_eq!(parse_info_request(&[]), None);
        let mut extra = ok.clone();
        extra.push(0);
        assert_eq!(parse_info_request(&extra), None);
    }
}
