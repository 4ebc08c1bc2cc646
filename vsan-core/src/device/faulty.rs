//! Placeholder: FaultyDevice is being written.
