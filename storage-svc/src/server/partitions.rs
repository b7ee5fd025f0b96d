//! The order in which requests that conflict over a partition run, while a request handled in
//! slices holds it (see the core's `sliced` module): one fair (first come, first served)
//! read-write lock per partition, made on first use and dropped when no request holds or
//! waits for it. A request takes its partition's lock only to run in slices, or when the
//! core says it would see such a request half done ([`Unit::waits`](crate::core::Unit)).

use std::collections::HashMap;
use std::sync::Arc;

use tessera_sync::Mutex;
use tokio::sync::{OwnedRwLockReadGuard, OwnedRwLockWriteGuard, RwLock};

use crate::core::Access;

/// The partitions' locks, by name.
#[derive(Default, Clone)]
pub(super) struct PartitionLocks {
    by: Arc<Mutex<HashMap<String, Arc<RwLock<()>>>>>,
}

enum Guard {
    Read(#[allow(dead_code)] OwnedRwLockReadGuard<()>),
    Write(#[allow(dead_code)] OwnedRwLockWriteGuard<()>),
}

/// A partition held with an [`Access`]; released on drop.
pub(super) struct PartitionGuard {
    locks: PartitionLocks,
    name: String,
    access: Access,
    guard: Option<Guard>,
}

impl PartitionGuard {
    pub(super) fn access(&self) -> Access {
        self.access
    }

    pub(super) fn name(&self) -> &str {
        &self.name
    }
}

impl PartitionLocks {
    /// Waits until `name` can be held with `access`, after those that asked before.
    pub(super) async fn acquire(&self, name: &str, access: Access) -> PartitionGuard {
        let lock = self.by.lock().entry(name.to_owned()).or_default().clone();
        // Made before the wait, and the wait after it: a request dropped while it waits
        // drops the wait (its reference to the lock) first, then forgets the lock.
        let mut held = PartitionGuard {
            locks: self.clone(),
            name: name.to_owned(),
            access,
            guard: None,
        };
        match access {
            Access::Read => {
                let wait = lock.read_owned();
                held.guard = Some(Guard::Read(wait.await));
            }
            Access::Write => {
                let wait = lock.write_owned();
                held.guard = Some(Guard::Write(wait.await));
            }
        }
        held
    }

    /// Partitions with a lock (held or waited for).
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.by.lock().len()
    }
}

impl Drop for PartitionGuard {
    fn drop(&mut self) {
        let mut by = self.locks.by.lock();
        self.guard = None;
        // Only the map holds it now: no request holds or waits for it.
        if by
            .get(&self.name)
            .is_some_and(|l| Arc::strong_count(l) == 1)
        {
            by.remove(&self.name);
        }
    }
}
