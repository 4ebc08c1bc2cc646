//! A crashed cache device opened with `WriteBackCache::open`: see
//! `vsan_cache_fuzz::check_recover`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    vsan_cache_fuzz::check_recover(data);
});
