//! A request's bulk work (the decode of a request of megabytes: a GET of a million keys) on a
//! thread of its own in Linux's idle scheduling class. The unit's workers serve every
//! session's small requests on the same cores. At equal priority a worker woken by one waits
//! for the bulk thread's time slice to end (milliseconds). At nice 10 it still did, now and
//! then: beside a session storing 2^18 keys per PUT, `perf sched` showed the bulk thread
//! running 3 ms at a stretch while the unit's worker and its shm engine's thread, woken, waited
//! as long. An idle-class thread gives way to any other the moment it wakes. A job the
//! workers' load starves there (one that ran less than a tenth of [`STARVE_CHECK`]) is moved
//! to nice [`BULK_NICE`], where it gets its share. A session runs one request at a time, so it
//! has at most one such thread.

use std::time::Duration;

/// How much nicer a bulk thread is than the thread that starts it (the workers keep the
/// process's own priority), from the start where the idle class is refused, once starved
/// where not.
const BULK_NICE: i32 = 10;

/// The highest nice value Linux gives.
const NICEST: i32 = 19;

/// How often a bulk job in the idle class is checked for starving.
const STARVE_CHECK: Duration = Duration::from_millis(20);

/// Runs `job` on a new thread in the idle class and waits for it; on the blocking pool at the
/// process's priority where no thread can be started. `None` if the job panicked.
pub(super) async fn run<T, F>(job: F) -> Option<T>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    let (done_tx, mut done_rx) = tokio::sync::oneshot::channel();
    let (job_tx, job_rx) = std::sync::mpsc::channel::<F>();
    let nice = (nice_now() + BULK_NICE).min(NICEST);
    let spawned = std::thread::Builder::new()
        .name("tessera-bulk".into())
        .spawn(move || {
            set_nice(nice);
            idle_class();
            if let Ok(job) = job_rx.recv() {
                let _ = done_tx.send(job());
            }
        });
    let thread = match spawned {
        Ok(thread) => thread,
        Err(e) => {
            tracing::debug!(error = %e, "no thread for a bulk decode; using the blocking pool");
            return tokio::task::spawn_blocking(job).await.ok();
        }
    };
    // The thread waits for the job, so it is there to take it.
    job_tx.send(job).ok()?;
    // The handle keeps the thread's id valid until it is dropped, finished or not.
    let id = std::os::unix::thread::JoinHandleExt::as_pthread_t(&thread);
    let mut ran = cpu_time(id);
    loop {
        tokio::select! {
            done = &mut done_rx => return done.ok(),
            _ = tokio::time::sleep(STARVE_CHECK) => {}
        }
        let now = cpu_time(id);
        match (ran, now) {
            (Some(before), Some(after)) if after.saturating_sub(before) >= STARVE_CHECK / 10 => {
                ran = now;
            }
            _ => break,
        }
    }
    fair_class(id);
    done_rx.await.ok()
}

/// [`run`] where `heavy`, else `job` here; `None` if it panicked on its thread.
pub(super) async fn run_if<T, F>(heavy: bool, job: F) -> Option<T>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    match heavy {
        true => run(job).await,
        false => Some(job()),
    }
}

/// The calling thread's nice value.
#[allow(unsafe_code)] // FFI: getpriority(2).
fn nice_now() -> i32 {
    // SAFETY: getpriority takes no pointers; with PRIO_PROCESS and who = 0 it reads the
    // calling thread's nice value (Linux schedules threads one by one).
    unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) }
}

/// Sets the calling thread's nice value; a thread that may not keeps its own.
#[allow(unsafe_code)] // FFI: setpriority(2).
fn set_nice(nice: i32) {
    // SAFETY: setpriority takes no pointers; with PRIO_PROCESS and who = 0 it sets the nice
    // value of the calling thread only.
    let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, nice) };
    if rc != 0 {
        tracing::debug!(
            error = %std::io::Error::last_os_error(),
            "a bulk thread keeps the process's priority"
        );
    }
}

/// Puts the calling thread in the idle class, keeping its nice value for [`fair_class`]; a
/// thread that may not stays as it is.
#[allow(unsafe_code)] // FFI: sched_setscheduler(2).
fn idle_class() {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: sched_setscheduler reads `param` and changes the calling thread (pid 0) only.
    if unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) } != 0 {
        tracing::debug!(
            error = %std::io::Error::last_os_error(),
            "a bulk thread stays at its nice value"
        );
    }
}

/// Moves the thread `id` (of a handle not yet dropped) back to the normal class, at the nice
/// value it had.
#[allow(unsafe_code)] // FFI: pthread_setschedparam(3).
fn fair_class(id: libc::pthread_t) {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: `id` is a thread whose handle the caller holds, so it is not reused; the call
    // reads `param` and changes that thread's policy only.
    let rc = unsafe { libc::pthread_setschedparam(id, libc::SCHED_OTHER, &param) };
    if rc != 0 {
        tracing::debug!(
            error = %std::io::Error::from_raw_os_error(rc),
            "a starved bulk thread stays in the idle class"
        );
    }
}

/// The CPU time the thread `id` (of a handle not yet dropped) has run; `None` where it cannot be
/// read.
#[allow(unsafe_code)] // FFI: pthread_getcpuclockid(3), clock_gettime(2).
fn cpu_time(id: libc::pthread_t) -> Option<Duration> {
    let mut clock: libc::clockid_t = 0;
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `id` is a thread whose handle the caller holds; both calls write only the
    // locals they are given.
    let ok = unsafe {
        libc::pthread_getcpuclockid(id, &mut clock) == 0 && libc::clock_gettime(clock, &mut t) == 0
    };
    ok.then(|| Duration::new(t.tv_sec as u64, t.tv_nsec as u32))
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::{nice_now, run, BULK_NICE, NICEST};
    use crate::testing::{current_cpu, pin, Spinner};

    /// The calling thread's scheduling policy.
    #[allow(unsafe_code)] // FFI: sched_getscheduler(2).
    fn policy() -> i32 {
        // SAFETY: sched_getscheduler takes no pointers; pid 0 is the calling thread.
        unsafe { libc::sched_getscheduler(0) }
    }

    #[tokio::test]
    async fn runs_the_job_at_a_lower_priority_and_survives_its_panic() {
        let expected = (nice_now() + BULK_NICE).min(NICEST);
        assert_eq!(run(nice_now).await, Some(expected));
        assert_eq!(run(policy).await, Some(libc::SCHED_IDLE));
        // The caller keeps its own priority.
        assert!(nice_now() < expected || expected == NICEST);
        assert_eq!(policy(), libc::SCHED_OTHER);
        let panicked: Option<()> = run(|| panic!("a job that panics")).await;
        assert_eq!(panicked, None);
    }

    /// A job whose core a thread of the normal class keeps busy gets next to nothing in the
    /// idle class; it is moved to its nice value, and finishes.
    #[tokio::test]
    async fn a_starved_job_leaves_the_idle_class() {
        let cpu = current_cpu();
        let spinner = Spinner::on(cpu);
        let job = run(move || {
            assert!(pin(cpu));
            let start = Instant::now();
            while policy() == libc::SCHED_IDLE && start.elapsed() < Duration::from_secs(20) {
                std::hint::spin_loop();
            }
            (policy(), nice_now())
        });
        let (policy, nice) = job.await.unwrap();
        drop(spinner);
        assert_eq!(policy, libc::SCHED_OTHER);
        assert_eq!(nice, (nice_now() + BULK_NICE).min(NICEST));
    }
}
