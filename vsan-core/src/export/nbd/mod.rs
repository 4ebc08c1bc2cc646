//! NBD export (placeholder while the server is written).
