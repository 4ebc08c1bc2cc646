//! The management API of a node, `vsan.mgmt.v1` (gRPC, `proto/mgmt.proto`): the
//! generated messages, server trait ([`v1::mgmt_server::Mgmt`]) and client
//! ([`v1::mgmt_client::MgmtClient`]), and the bearer-token check both sides use.
//!
//! The server's implementation lives with the node (`vsan::node`), which owns the disks;
//! this module holds what a server and a client share.

use std::sync::Arc;

use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::{Request, Status};
use vsan_core::{Error, ErrorKind};

/// The generated `vsan.mgmt.v1` messages, server and client.
#[allow(missing_docs, clippy::all, missing_debug_implementations)]
pub mod v1 {
    tonic::include_proto!("vsan.mgmt.v1");
}

/// The codec of `vsan.mgmt.v1`: prost's, except that a message that does not decode is
/// `INVALID_ARGUMENT` (the caller sent a malformed request) rather than prost's
/// `INTERNAL`.
#[derive(Debug, Clone)]
pub struct Codec<T, U>(tonic_prost::ProstCodec<T, U>);

impl<T, U> Default for Codec<T, U> {
    fn default() -> Self {
        Codec(tonic_prost::ProstCodec::default())
    }
}

impl<T, U> tonic::codec::Codec for Codec<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = tonic_prost::ProstEncoder<T>;
    type Decoder = Decoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        self.0.encoder()
    }

    fn decoder(&mut self) -> Self::Decoder {
        Decoder(self.0.decoder())
    }
}

/// The decoder of [`Codec`].
#[derive(Debug)]
pub struct Decoder<U>(tonic_prost::ProstDecoder<U>);

impl<U: prost::Message + Default> tonic::codec::Decoder for Decoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut tonic::codec::DecodeBuf<'_>) -> Result<Option<U>, Status> {
        self.0.decode(buf).map_err(|s| {
            if s.code() == tonic::Code::Internal {
                Status::invalid_argument(format!("malformed message: {}", s.message()))
            } else {
                s
            }
        })
    }

    fn buffer_settings(&self) -> tonic::codec::BufferSettings {
        self.0.buffer_settings()
    }
}

/// Server side: requests must carry `authorization: Bearer <token>` when a token is set.
/// Compared in constant time; a missing or wrong token is `UNAUTHENTICATED`.
#[derive(Clone)]
pub struct RequireToken {
    token: Option<Arc<[u8]>>,
}

impl std::fmt::Debug for RequireToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequireToken")
            .field("token", &self.token.as_ref().map(|_| "<set>"))
            .finish()
    }
}

impl RequireToken {
    /// Check requests against `token` (`None`: every request passes).
    pub fn new(token: Option<&str>) -> RequireToken {
        RequireToken {
            token: token.map(|t| Arc::from(t.as_bytes())),
        }
    }
}

/// Whether `a` and `b` are equal, in time that depends only on their lengths.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl Interceptor for RequireToken {
    fn call(&mut self, req: Request<()>) -> Result<Request<()>, Status> {
        let Some(want) = &self.token else {
            return Ok(req);
        };
        let given = req
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        match given {
            Some(t) if same(t.as_bytes(), want) => Ok(req),
            Some(_) => Err(Status::unauthenticated("wrong bearer token")),
            None => Err(Status::unauthenticated(
                "this node requires a bearer token (authorization: Bearer <token>)",
            )),
        }
    }
}

/// Client side: adds `authorization: Bearer <token>` to every request when a token is
/// set.
#[derive(Clone, Debug)]
pub struct AddToken {
    value: Option<MetadataValue<Ascii>>,
}

impl AddToken {
    /// Add `token` (`None`: nothing). Fails ([`ErrorKind::InvalidArgument`]) when the
    /// token is not printable ASCII.
    pub fn new(token: Option<&str>) -> vsan_core::Result<AddToken> {
        let value = match token {
            None => None,
            Some(t) => Some(format!("Bearer {t}").parse().map_err(|_| {
                Error::new(
                    ErrorKind::InvalidArgument,
                    "the token must be printable ASCII",
                )
            })?),
        };
        Ok(AddToken { value })
    }
}

impl Interceptor for AddToken {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        if let Some(v) = &self.value {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens() {
        let mut check = RequireToken::new(Some("s3cret"));
        let mut add = AddToken::new(Some("s3cret")).unwrap();
        assert!(check.call(add.call(Request::new(())).unwrap()).is_ok());
        let mut wrong = AddToken::new(Some("s3cres")).unwrap();
        let e = check
            .call(wrong.call(Request::new(())).unwrap())
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        let e = check.call(Request::new(())).unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        assert!(RequireToken::new(None).call(Request::new(())).is_ok());
        assert!(AddToken::new(Some("bad\ntoken")).is_err());
    }
}
