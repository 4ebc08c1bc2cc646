//! Model-based property tests of vsan (the tests live in `tests/`); this library holds the
//! reference model they compare against.
#![deny(missing_docs)]
