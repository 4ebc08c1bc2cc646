//! Cross-process loopback links over shared-memory rings.
