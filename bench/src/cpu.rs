//! Pinning the benchmark's processes to cores, so that two processes on a 2-core machine do
//! not trade places mid-measurement.

use anyhow::{bail, Result};

pub(crate) fn pin(cpu: usize) -> Result<()> {
    // The machine's cores, not this process's: `available_parallelism` counts the affinity
    // mask, which a child inherits from a parent already pinned to one core.
    // SAFETY: sysconf has no memory-safety obligations.
    let online = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    let cpu = cpu % usize::try_from(online).unwrap_or(1).max(1);
    // SAFETY: a zeroed cpu_set_t is an empty set; CPU_SET writes inside it; the call only
    // reads the set.
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set)
    };
    if rc != 0 {
        bail!(
            "sched_setaffinity to cpu {cpu}: {}",
            std::io::Error::last_os_error()
        );
    }
    Ok(())
}

pub(crate) fn affinity() -> Option<libc::cpu_set_t> {
    // SAFETY: a zeroed cpu_set_t is valid; the call writes at most its size.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        (libc::sched_getaffinity(0, size_of::<libc::cpu_set_t>(), &mut set) == 0).then_some(set)
    }
}

pub(crate) fn restore_affinity(set: &libc::cpu_set_t) {
    // SAFETY: `set` is a valid cpu set; the call only reads it.
    unsafe { libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), set) };
}
