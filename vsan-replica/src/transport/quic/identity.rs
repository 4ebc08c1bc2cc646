//! Who a QUIC node is and whom it trusts: its [`Identity`] (certificate and key), the
//! [`Fingerprint`]s it pins, and the [`CaCertificates`] it may trust instead.

use std::fmt;
use std::fs;
use std::io::{self, Write as _};
use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;

use rustls::RootCertStore;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use sha2::{Digest, Sha256};
use vsan_core::{Error, ErrorKind, Result};

use super::{crypto_provider, invalid};

// ----- fingerprints -----

/// The SHA-256 hash of a certificate's DER bytes, to pin a peer's certificate.
///
/// Prints as `sha256:` and 64 lowercase hex digits. Parses from that form, and also from
/// the hex digits alone or as 32 colon-separated pairs (`AB:CD:…`, as `openssl x509
/// -fingerprint -sha256` prints them), in any case, with or without the `sha256:`
/// prefix.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// The fingerprint of a certificate given as DER bytes.
    pub fn of_certificate(der: &[u8]) -> Fingerprint {
        Fingerprint(Sha256::digest(der).into())
    }

    /// A fingerprint from its 32 bytes.
    pub fn from_bytes(bytes: [u8; 32]) -> Fingerprint {
        Fingerprint(bytes)
    }

    /// Its 32 bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("sha256:")?;
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({self})")
    }
}

impl FromStr for Fingerprint {
    type Err = Error;

    /// Fails with [`InvalidArgument`](vsan_core::ErrorKind::InvalidArgument), saying
    /// what is wrong, for anything but the forms in the [type docs](Fingerprint).
    fn from_str(text: &str) -> Result<Fingerprint> {
        let bad = |why: String| {
            invalid(format!(
                "certificate fingerprint {text:?}: {why}; expected \"sha256:\" and 64 hex \
                 digits (the SHA-256 of the certificate's DER bytes), optionally as 32 \
                 colon-separated pairs"
            ))
        };
        let s = text.trim();
        let hex = match s.get(..7) {
            Some(prefix) if prefix.eq_ignore_ascii_case("sha256:") => &s[7..],
            _ => s,
        };
        let digits: Vec<u8> = if hex.contains(':') {
            let pairs: Vec<&str> = hex.split(':').collect();
            if pairs.len() != 32 || pairs.iter().any(|p| p.len() != 2) {
                return Err(bad(
                    "with colons, it must be 32 pairs of hex digits".to_string()
                ));
            }
            pairs.concat().into_bytes()
        } else {
            hex.as_bytes().to_vec()
        };
        if let Some(c) = hex.chars().find(|c| !c.is_ascii_hexdigit() && *c != ':') {
            return Err(bad(format!("{c:?} is not a hex digit")));
        }
        if digits.len() != 64 {
            return Err(bad(format!("{} hex digits", digits.len())));
        }
        let mut bytes = [0u8; 32];
        for (byte, pair) in bytes.iter_mut().zip(digits.chunks_exact(2)) {
            *byte = (nibble(pair[0]) << 4) | nibble(pair[1]);
        }
        Ok(Fingerprint(bytes))
    }
}

/// The value of one ASCII hex digit (already checked to be one).
fn nibble(c: u8) -> u8 {
    match c {
        b'0'..=b'9' => c - b'0',
        b'a'..=b'f' => c - b'a' + 10,
        b'A'..=b'F' => c - b'A' + 10,
        _ => 0,
    }
}

// ----- identities -----

/// This node's certificate chain and private key. Cheap to clone; the key never
/// appears in `Debug` output.
#[derive(Clone)]
pub struct Identity(Arc<IdentityInner>);

struct IdentityInner {
    /// Leaf first.
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    fingerprint: Fingerprint,
}

impl Identity {
    /// An identity from a PEM certificate chain (leaf first, then any intermediates) and
    /// a PEM private key (PKCS#8, PKCS#1 or SEC1). Fails with
    /// [`InvalidArgument`](vsan_core::ErrorKind::InvalidArgument) when either does not
    /// parse, or the key is not the certificate's.
    pub fn from_pem(cert_pem: &[u8], key_pem: &[u8]) -> Result<Identity> {
        let chain = parse_certificates(cert_pem).map_err(|e| e.context_prefix("certificate"))?;
        let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| {
            Error::with_source(
                ErrorKind::InvalidArgument,
                "private key: no PEM private key (PKCS#8, PKCS#1 or SEC1) found",
                e,
            )
        })?;
        Identity::new(chain, key)
    }

    /// An identity from DER: the certificate chain (leaf first) and a private key
    /// (PKCS#8, PKCS#1 or SEC1). Fails like [`from_pem`](Identity::from_pem).
    pub fn from_der(chain: Vec<Vec<u8>>, key: Vec<u8>) -> Result<Identity> {
        let chain = chain.into_iter().map(CertificateDer::from).collect();
        let key = PrivateKeyDer::try_from(key)
            .map_err(|e| invalid(format!("private key: not a DER private key: {e}")))?;
        Identity::new(chain, key)
    }

    /// An identity from a PEM certificate file and a PEM key file (see
    /// [`from_pem`](Identity::from_pem)).
    pub fn from_pem_files(
        cert_path: impl AsRef<Path>,
        key_path: impl AsRef<Path>,
    ) -> Result<Identity> {
        let (cert_path, key_path) = (cert_path.as_ref(), key_path.as_ref());
        let cert = fs::read(cert_path)
            .map_err(|e| Error::io(format!("read certificate {}", cert_path.display()), e))?;
        let key = fs::read(key_path)
            .map_err(|e| Error::io(format!("read private key {}", key_path.display()), e))?;
        Identity::from_pem(&cert, &key).map_err(|e| {
            e.context_prefix(format!(
                "identity from {} and {}",
                cert_path.display(),
                key_path.display()
            ))
        })
    }

    /// A fresh self-signed identity (ECDSA P-256) for `name`, which becomes the
    /// certificate's common name and subject alternative name (a DNS name, or an IP
    /// address when it parses as one). Peers pin its [`fingerprint`](Identity::fingerprint).
    pub fn generate(name: &str) -> Result<Identity> {
        let (cert, key) = generate_pem(name)?;
        Identity::from_pem(cert.as_bytes(), key.as_bytes())
    }

    /// Loads the identity from `cert_path` and `key_path` when both exist; when neither
    /// does, generates one (see [`generate`](Identity::generate)) and writes both files
    /// first (each through a temporary file and a rename, so a crash leaves no half
    /// file; the key file with mode 0600), creating their directories. So a node keeps
    /// one identity, and one fingerprint, across restarts. When only one of the files
    /// exists this fails with [`InvalidArgument`](vsan_core::ErrorKind::InvalidArgument)
    /// rather than replace half an identity.
    pub fn load_or_generate(
        cert_path: impl AsRef<Path>,
        key_path: impl AsRef<Path>,
        name: &str,
    ) -> Result<Identity> {
        let (cert_path, key_path) = (cert_path.as_ref(), key_path.as_ref());
        if cert_path == key_path {
            return Err(invalid(format!(
                "identity: certificate and private key must be two files, both are {}",
                cert_path.display()
            )));
        }
        let exists = |p: &Path| {
            p.try_exists()
                .map_err(|e| Error::io(format!("look for {}", p.display()), e))
        };
        match (exists(cert_path)?, exists(key_path)?) {
            (true, true) => Identity::from_pem_files(cert_path, key_path),
            (false, false) => {
                let (cert, key) = generate_pem(name)?;
                let identity = Identity::from_pem(cert.as_bytes(), key.as_bytes())?;
                write_atomically(key_path, key.as_bytes(), 0o600)?;
                if let Err(e) = write_atomically(cert_path, cert.as_bytes(), 0o644) {
                    // Leave no half identity behind: the next start generates afresh.
                    let _ = fs::remove_file(key_path);
                    return Err(e);
                }
                Ok(identity)
            }
            (true, false) => Err(invalid(format!(
                "identity: certificate {} exists but private key {} does not; restore the \
                 key, or remove the certificate to generate a new identity (its \
                 fingerprint changes, so peers must pin the new one)",
                cert_path.display(),
                key_path.display()
            ))),
            (false, true) => Err(invalid(format!(
                "identity: private key {} exists but certificate {} does not; restore the \
                 certificate, or remove the key to generate a new identity (its \
                 fingerprint changes, so peers must pin the new one)",
                key_path.display(),
                cert_path.display()
            ))),
        }
    }

    /// The fingerprint of this identity's leaf certificate, for peers to pin.
    pub fn fingerprint(&self) -> Fingerprint {
        self.0.fingerprint
    }

    /// The leaf certificate, DER.
    pub fn certificate_der(&self) -> &[u8] {
        &self.0.chain[0]
    }

    /// The certificate chain and a copy of the key, for a TLS configuration.
    pub(super) fn chain_and_key(&self) -> (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>) {
        (self.0.chain.clone(), self.0.key.clone_key())
    }

    fn new(chain: Vec<CertificateDer<'static>>, key: PrivateKeyDer<'static>) -> Result<Identity> {
        let Some(leaf) = chain.first() else {
            return Err(invalid("certificate: no certificate"));
        };
        let fingerprint = Fingerprint::of_certificate(leaf);
        rustls::sign::CertifiedKey::from_der(chain.clone(), key.clone_key(), &crypto_provider())
            .map_err(|e| {
                Error::with_source(
                    ErrorKind::InvalidArgument,
                    format!("identity {fingerprint}: unusable certificate or private key"),
                    e,
                )
            })?;
        Ok(Identity(Arc::new(IdentityInner {
            chain,
            key,
            fingerprint,
        })))
    }
}

impl fmt::Debug for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Identity")
            .field("fingerprint", &format_args!("{}", self.0.fingerprint))
            .field("chain_len", &self.0.chain.len())
            .field("key", &format_args!("<redacted>"))
            .finish()
    }
}

/// Every certificate in `pem`; at least one.
fn parse_certificates(pem: &[u8]) -> Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| Error::with_source(ErrorKind::InvalidArgument, "bad PEM", e))?;
    if certs.is_empty() {
        return Err(invalid("no PEM CERTIFICATE section found"));
    }
    Ok(certs)
}

/// A self-signed certificate and its key, PEM.
fn generate_pem(name: &str) -> Result<(String, String)> {
    if name.is_empty() {
        return Err(invalid("generate identity: empty name"));
    }
    let mut params = rcgen::CertificateParams::new(vec![name.to_string()])
        .map_err(|e| invalid(format!("generate identity: name {name:?}: {e}")))?;
    let mut dn = rcgen::DistinguishedName::new();
    dn.push(rcgen::DnType::CommonName, name);
    params.distinguished_name = dn;
    params.extended_key_usages = vec![
        rcgen::ExtendedKeyUsagePurpose::ServerAuth,
        rcgen::ExtendedKeyUsagePurpose::ClientAuth,
    ];
    let key = rcgen::KeyPair::generate().map_err(|e| {
        Error::new(
            ErrorKind::Io,
            format!("generate identity {name:?}: key generation failed: {e}"),
        )
    })?;
    let cert = params
        .self_signed(&key)
        .map_err(|e| invalid(format!("generate identity {name:?}: {e}")))?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// Writes `contents` to `path` through a temporary file in the same directory (created
/// with `mode` on Unix) and a rename, so `path` never holds part of it.
fn write_atomically(path: &Path, contents: &[u8], mode: u32) -> Result<()> {
    let ctx = || format!("write {}", path.display());
    let Some(file_name) = path.file_name() else {
        return Err(invalid(format!("{}: not a file name", ctx())));
    };
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    fs::create_dir_all(dir).map_err(|e| Error::io(ctx(), e))?;
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        file_name.to_string_lossy(),
        std::process::id()
    ));
    // A stale temporary file from a crashed start would keep its old mode.
    match fs::remove_file(&tmp) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(Error::io(ctx(), e)),
        _ => {}
    }
    let written = (|| -> io::Result<()> {
        let mut opts = fs::OpenOptions::new();
        opts.write(true).create_new(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut opts, mode);
        #[cfg(not(unix))]
        let _ = mode;
        let mut file = opts.open(&tmp)?;
        file.write_all(contents)?;
        file.sync_all()?;
        drop(file);
        fs::rename(&tmp, path)?;
        // The rename is durable once the directory is.
        #[cfg(unix)]
        fs::File::open(dir)?.sync_all()?;
        Ok(())
    })();
    written.map_err(|e| {
        let _ = fs::remove_file(&tmp);
        Error::io(ctx(), e)
    })
}

// ----- CA certificates -----

/// One or more CA certificates a peer's certificate chain must lead to (see
/// [`QuicConfig::peer_ca`](super::QuicConfig::peer_ca)).
#[derive(Clone)]
pub struct CaCertificates {
    certs: Vec<CertificateDer<'static>>,
}

impl CaCertificates {
    /// The CA certificates in `pem` (one or more `CERTIFICATE` sections). Fails with
    /// [`InvalidArgument`](vsan_core::ErrorKind::InvalidArgument) when there is none,
    /// or one is not a usable trust anchor.
    pub fn from_pem(pem: &[u8]) -> Result<CaCertificates> {
        let certs = parse_certificates(pem).map_err(|e| e.context_prefix("CA certificate"))?;
        let ca = CaCertificates { certs };
        ca.root_store()?;
        Ok(ca)
    }

    /// The CA certificates in the PEM file at `path` (see
    /// [`from_pem`](CaCertificates::from_pem)).
    pub fn from_pem_file(path: impl AsRef<Path>) -> Result<CaCertificates> {
        let path = path.as_ref();
        let pem = fs::read(path)
            .map_err(|e| Error::io(format!("read CA certificate {}", path.display()), e))?;
        CaCertificates::from_pem(&pem).map_err(|e| e.context_prefix(path.display()))
    }

    /// The fingerprints of the CA certificates, for logs.
    pub fn fingerprints(&self) -> Vec<Fingerprint> {
        self.certs
            .iter()
            .map(|c| Fingerprint::of_certificate(c))
            .collect()
    }

    pub(super) fn root_store(&self) -> Result<Arc<RootCertStore>> {
        let mut roots = RootCertStore::empty();
        for cert in &self.certs {
            roots.add(cert.clone()).map_err(|e| {
                Error::with_source(
                    ErrorKind::InvalidArgument,
                    format!(
                        "CA certificate {}: not a usable trust anchor",
                        Fingerprint::of_certificate(cert)
                    ),
                    e,
                )
            })?;
        }
        Ok(Arc::new(roots))
    }
}

impl fmt::Debug for CaCertificates {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let fps: Vec<String> = self.fingerprints().iter().map(|f| f.to_string()).collect();
        f.debug_tuple("CaCertificates").field(&fps).finish()
    }
}
