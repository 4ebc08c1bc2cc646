//! The witness worker: one task per witnessed disk that carries the driver's claims
//! and releases to the quorum witness, in order, and sends the answers back.

use tokio::sync::mpsc;
use tracing::warn;

use crate::witness::WitnessClient;

/// What the driver asks of its witness worker, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum WitnessRequest {
    /// Ask for the disk until it is granted (or a newer request comes).
    Claim,
    /// Give the disk back.
    Release,
}

/// Talks to the witness for one disk, one round trip at a time and in the order the
/// driver asked, so a release can never overtake a claim (or the reverse). A claim is
/// retried every second until granted, unless a newer request arrives.
pub(super) async fn witness_worker(
    w: WitnessClient,
    disk: String,
    mut requests: mpsc::UnboundedReceiver<WitnessRequest>,
    answers: mpsc::UnboundedSender<bool>,
) {
    let mut next = requests.recv().await;
    while let Some(req) = next.take() {
        match req {
            WitnessRequest::Release => {
                if let Err(e) = w.release(&disk).await {
                    warn!(disk = %disk, "could not release the witness's grant: {e}");
                }
            }
            WitnessRequest::Claim => loop {
                let granted = match w.claim(&disk).await {
                    Ok(g) => g,
                    Err(e) => {
                        warn!(disk = %disk, "witness {} unreachable: {e}", w.addr());
                        false
                    }
                };
                if answers.send(granted).is_err() {
                    return;
                }
                if granted {
                    break;
                }
                tokio::select! {
                    r = requests.recv() => {
                        next = r;
                        if next.is_none() {
                            return;
                        }
                        break;
                    }
                    _ = tokio::time::sleep(std::time::Duration::from_secs(1)) => {}
                }
            },
        }
        if next.is_none() {
            next = requests.recv().await;
        }
    }
}
