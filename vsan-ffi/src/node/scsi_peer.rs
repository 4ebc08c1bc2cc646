//! The mirror as the SCSI layer's link to the other node (issue 20): one
//! [`MirrorPeer`] per mirrored disk's logical unit is both the unit's
//! [`ScsiPeer`] (its calls ride the mirror link, in order with the writes) and the
//! mirror's [`ScsiHandler`] (the other node's calls reach the unit here).

use std::sync::{Arc, Weak};

use bytes::Bytes;
use tokio::sync::watch;
use vsan_core::device::IoFuture;
use vsan_core::scsi::{BackgroundTask, LogicalUnit, PeerLink, ScsiPeer};
use vsan_core::{BlockDevice, ErrorKind};
use vsan_replica::protocol::{LinkState, SyncRole};
use vsan_replica::{MirrorStatus, MirroredDisk, ScsiFuture, ScsiHandler};

/// See the module docs.
pub(super) struct MirrorPeer {
    disk: MirroredDisk,
    resolver: bool,
    status: watch::Receiver<MirrorStatus>,
    lu: Weak<LogicalUnit>,
    /// The runtime the unit's background work runs on when it is started from outside
    /// one (a guard dropped on a foreign thread).
    runtime: Option<tokio::runtime::Handle>,
}

impl MirrorPeer {
    /// Link `lu` (over `disk`) with the other node's unit: sets the unit's peer and the
    /// mirror's SCSI handler. `resolver`: this node has the lower node id.
    pub(super) fn link(disk: &MirroredDisk, lu: &Arc<LogicalUnit>, resolver: bool) {
        let peer = Arc::new(MirrorPeer {
            disk: disk.clone(),
            resolver,
            status: disk.watch_status(),
            lu: Arc::downgrade(lu),
            runtime: tokio::runtime::Handle::try_current().ok(),
        });
        let handler: Arc<dyn ScsiHandler> = peer.clone();
        disk.set_scsi_handler(Arc::downgrade(&handler));
        lu.set_peer(peer);
    }
}

/// How the unit sees the mirror link in `status`: what the link's handshake decided
/// about this node's replica, for the life of the link (a resync it started may be over
/// by the time the units settle their reservation state: the decision still holds).
pub(super) fn peer_link(status: &MirrorStatus) -> PeerLink {
    if status.link != LinkState::Connected {
        return PeerLink::Away;
    }
    match status.link_role {
        Some(SyncRole::Source) => PeerLink::Source,
        Some(SyncRole::Target) => PeerLink::Target,
        None => PeerLink::InSync,
    }
}

impl ScsiPeer for MirrorPeer {
    fn is_resolver(&self) -> bool {
        self.resolver
    }

    fn link(&self) -> PeerLink {
        peer_link(&self.status.borrow())
    }

    fn call(&self, msg: Bytes) -> IoFuture<'_, Bytes> {
        Box::pin(self.disk.scsi_call(msg))
    }

    fn changed_alone(&self) -> IoFuture<'_, ()> {
        self.disk.flush()
    }

    fn link_id(&self) -> u64 {
        self.status.borrow().link_epoch.unwrap_or(0)
    }

    fn spawn(&self, task: BackgroundTask) {
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => drop(rt.spawn(task)),
            Err(_) => match &self.runtime {
                Some(rt) => drop(rt.spawn(task)),
                None => tracing::warn!(
                    "a SCSI background task (a message to the other node) had no runtime to run on"
                ),
            },
        }
    }
}

impl ScsiHandler for MirrorPeer {
    fn call(&self, body: Bytes) -> ScsiFuture {
        let lu = self.lu.upgrade();
        Box::pin(async move {
            match lu {
                Some(lu) => lu.on_peer_message(body).await.map_err(|e| {
                    tracing::warn!("a SCSI call from the other node failed: {e}");
                    e.kind()
                }),
                None => Err(ErrorKind::Closed),
            }
        })
    }
}

/// The reservation state of a mirrored disk's unit, kept in the replica's metadata
/// ([`MirroredDisk::save_scsi_state`]) rather than in a file of its own: it travels
/// with the replica, and which node's state stands follows the handshake's decision
/// about the data.
struct MetadataStore {
    disk: MirroredDisk,
}

impl vsan_core::scsi::PrStore for MetadataStore {
    fn save<'a>(&'a self, state: &'a vsan_core::scsi::PrState) -> IoFuture<'a, ()> {
        let bytes = Bytes::from(state.encode());
        Box::pin(self.disk.save_scsi_state(bytes))
    }
}

/// Keep `lu`'s reservation state in `disk`'s metadata: load what is saved there (with a
/// power on: only APTPL state survives it) or, the first time, what an older version
/// left in `old_file` (`data_dir/<disk>.scsi-state`), which is moved into the metadata
/// and removed. Runs before the unit serves.
pub(super) async fn keep_in_metadata(
    lu: &Arc<LogicalUnit>,
    disk: &MirroredDisk,
    old_file: Option<&std::path::Path>,
) -> vsan_core::Result<()> {
    let saved = match disk.scsi_state().await? {
        Some(b) => Some(vsan_core::scsi::PrState::decode(&b).map_err(|e| {
            vsan_core::Error::with_source(
                ErrorKind::Corrupt,
                format!("disk {}: the SCSI state in the metadata", disk.name()),
                e,
            )
        })?),
        None => None,
    };
    // The first start after an older version: its state file, moved into the metadata.
    let (state, migrated) = match (saved, old_file) {
        (Some(s), _) => (Some(s), None),
        (None, Some(path)) => {
            let s = vsan_core::scsi::read_state_file(path)?;
            let moved = s.is_some().then_some(path);
            (s, moved)
        }
        (None, None) => (None, None),
    };
    lu.set_pr_store(Arc::new(MetadataStore { disk: disk.clone() }));
    if let Some(mut state) = state {
        state.power_on();
        // Saved into the metadata again (the first time: moved there).
        lu.install_pr_state(state).await?;
    }
    if let Some(path) = migrated {
        std::fs::remove_file(path)
            .map_err(|e| vsan_core::Error::io(format!("remove {}", path.display()), e))?;
        tracing::info!(
            disk = %disk.name(),
            "the SCSI state moved from {} into the replica's metadata",
            path.display()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use vsan_core::scsi::{LuConfig, LuIdentity, PrState, Registration, TargetPort};
    use vsan_core::{Geometry, MemDevice};
    use vsan_replica::meta::{self, Layout};
    use vsan_replica::protocol::{Config, DiskId};
    use vsan_replica::{Replica, meta_params};

    use super::*;

    const SIZE: u64 = 1 << 20;

    /// A mirrored disk (its peer never comes) whose metadata has the SCSI state area.
    async fn disk() -> MirroredDisk {
        let cfg = Config::new(1, 2, DiskId::from_name("vol0"), "vol0", SIZE, 512);
        let p = meta_params(&cfg, meta::DEFAULT_CHUNK_SIZE);
        let l = Layout::new(SIZE, p.chunk_size);
        let dev: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(
            Geometry::new(l.total_len_with_scsi(), 512).unwrap(),
        ));
        let loaded = meta::create(dev.as_ref(), &p).await.unwrap();
        let data: Arc<dyn BlockDevice> =
            Arc::new(MemDevice::new(Geometry::new(SIZE, 512).unwrap()));
        MirroredDisk::start(
            cfg,
            Replica {
                data,
                meta: dev,
                loaded,
            },
            None,
        )
        .unwrap()
    }

    fn unit(disk: &MirroredDisk) -> Arc<LogicalUnit> {
        let config = LuConfig {
            identity: LuIdentity::from_disk_id("vol0"),
            port: TargetPort {
                name: "iqn.2026-12.test:vol0,t,0x0001".into(),
                relative_id: 1,
                group: 1,
            },
            read_only: false,
            state_file: None,
        };
        LogicalUnit::new(Arc::new(disk.clone()), config).unwrap()
    }

    /// [`saved_state`] as a state file holds it. (Its next registration id, private to
    /// the SCSI layer, is set in the bytes: 2, past the registration's.)
    fn saved_bytes() -> Vec<u8> {
        let mut b = saved_state().encode();
        b[11..19].copy_from_slice(&2u64.to_be_bytes());
        let body = b.len() - 4;
        let crc = crc32fast::hash(&b[..body]);
        b[body..].copy_from_slice(&crc.to_be_bytes());
        b
    }

    /// An APTPL state with one registration (it survives the power on of a start).
    fn saved_state() -> PrState {
        let mut s = PrState::new();
        s.generation = 3;
        s.aptpl = true;
        s.registrations.push(Registration {
            id: 1,
            key: 0xAB,
            initiator_port: "iqn.2026-12.test:host,i,0x000000000001".into(),
            transport_id: b"tid".to_vec(),
            relative_target_port: 1,
            all_tg_pt: false,
            name_only: false,
        });
        s
    }

    #[tokio::test]
    async fn an_old_state_file_moves_into_the_metadata_and_later_starts_load_it_there() {
        let dir = tempfile::tempdir().unwrap();
        let old = dir.path().join("vol0.scsi-state");
        std::fs::write(&old, saved_bytes()).unwrap();
        let disk = disk().await;
        let lu = unit(&disk);
        keep_in_metadata(&lu, &disk, Some(&old)).await.unwrap();
        let got = lu.pr_state();
        assert_eq!(got.registrations, saved_state().registrations);
        assert_eq!(got.generation, 3);
        assert!(!old.exists(), "the old file is left behind");
        let in_meta = disk
            .scsi_state()
            .await
            .unwrap()
            .expect("saved in the metadata");
        assert_eq!(PrState::decode(&in_meta).unwrap(), got);

        // The next start of a unit over the same replica loads it from there.
        let again = unit(&disk);
        keep_in_metadata(&again, &disk, Some(&old)).await.unwrap();
        assert_eq!(again.pr_state().registrations, got.registrations);

        // A bad state in the metadata is refused, never served as empty.
        disk.save_scsi_state(Bytes::from_static(b"garbage"))
            .await
            .unwrap();
        let e = keep_in_metadata(&unit(&disk), &disk, None)
            .await
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
    }
}
