//! QUIC links with mutual TLS (quinn, rustls).
