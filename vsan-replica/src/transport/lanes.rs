//! Lanes: several links to one peer, frames scheduled by least queue depth.
