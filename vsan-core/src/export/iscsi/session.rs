//! (to be written)

