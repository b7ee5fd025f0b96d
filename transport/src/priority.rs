//! Scheduling priority of threads while they do bulk work. A thread that copies megabytes
//! shares its core with the threads that serve small requests; at equal priority a woken
//! server waits for the copier's time slice to end (milliseconds), at a lower one it preempts
//! it at once. Linux schedules threads one by one, so these act on the calling thread only.

use std::sync::OnceLock;

/// The highest nice value Linux gives.
pub const NICEST: i32 = 19;

/// The calling thread's nice value.
pub fn nice() -> i32 {
    // SAFETY: getpriority takes no pointers; with PRIO_PROCESS and who = 0 it reads the
    // calling thread's nice value.
    unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) }
}

fn set_nice(value: i32) -> bool {
    // SAFETY: setpriority takes no pointers; with PRIO_PROCESS and who = 0 it sets the nice
    // value of the calling thread only.
    unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, value) == 0 }
}

/// Makes the calling thread `by` nicer (up to [`NICEST`]) for the rest of its life, for a
/// thread that only ever does bulk work. `false` where the thread may not (it keeps its
/// priority).
pub fn lower_priority(by: i32) -> bool {
    set_nice(nice().saturating_add(by.max(0)).min(NICEST))
}

/// Whether this process's threads may take back a priority they gave up: with
/// `CAP_SYS_NICE`, or an `RLIMIT_NICE` that allows their nice value (neither by default for
/// an unprivileged process, nor in a container that drops the capability). Tried once, on a
/// thread of its own.
pub fn can_restore() -> bool {
    static CAN: OnceLock<bool> = OnceLock::new();
    *CAN.get_or_init(|| {
        std::thread::spawn(|| {
            let before = nice();
            before < NICEST && set_nice(before + 1) && set_nice(before)
        })
        .join()
        .unwrap_or(false)
    })
}

/// Runs `f` with the calling thread `by` nicer, then gives it its priority back; where it
/// could not take it back ([`can_restore`]), `f` runs at the thread's own priority.
pub fn nicer_while<T>(by: i32, f: impl FnOnce() -> T) -> T {
    if by <= 0 || !can_restore() {
        return f();
    }
    let before = nice();
    let lowered = set_nice(before.saturating_add(by).min(NICEST));
    let out = f();
    if lowered {
        set_nice(before);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_calling_thread_is_lowered_for_good() {
        let before = nice();
        let lowered = std::thread::spawn(move || (lower_priority(5), nice()))
            .join()
            .unwrap();
        assert_eq!(lowered, (true, (before + 5).min(NICEST)));
        assert_eq!(nice(), before);
        let capped = std::thread::spawn(|| (lower_priority(100), nice()))
            .join()
            .unwrap();
        assert_eq!(capped, (true, NICEST));
    }

    #[test]
    fn nicer_while_gives_the_priority_back() {
        std::thread::spawn(|| {
            let before = nice();
            let inside = nicer_while(3, nice);
            if can_restore() {
                assert_eq!(inside, (before + 3).min(NICEST));
            } else {
                assert_eq!(inside, before);
            }
            assert_eq!(nice(), before);
        })
        .join()
        .unwrap();
    }
}
