//! A request's bulk work (the decode of a request of megabytes: a GET of a million keys) on a
//! thread of its own at a lower scheduling priority. The unit's workers serve every
//! session's small requests on the same cores; at equal priority a worker woken by one waits
//! for the bulk thread's time slice to end (milliseconds), at a lower one it preempts it at
//! once. A session runs one request at a time, so it has at most one such thread.

/// How much nicer a bulk thread is than the thread that starts it (the workers keep the
/// process's own priority).
const BULK_NICE: i32 = 10;

/// The highest nice value Linux gives.
const NICEST: i32 = 19;

/// Runs `job` on a new thread [`BULK_NICE`] nicer than the caller and waits for it; on the blocking pool at
/// the process's priority where no thread can be started. `None` if the job panicked.
pub(super) async fn run<T, F>(job: F) -> Option<T>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    let (job_tx, job_rx) = std::sync::mpsc::channel::<F>();
    let nice = (nice_now() + BULK_NICE).min(NICEST);
    let spawned = std::thread::Builder::new()
        .name("tessera-bulk".into())
        .spawn(move || {
            set_nice(nice);
            if let Ok(job) = job_rx.recv() {
                let _ = done_tx.send(job());
            }
        });
    if let Err(e) = spawned {
        tracing::debug!(error = %e, "no thread for a bulk decode; using the blocking pool");
        return tokio::task::spawn_blocking(job).await.ok();
    }
    // The thread waits for the job, so it is there to take it.
    job_tx.send(job).ok()?;
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

#[cfg(test)]
mod tests {
    use super::{nice_now, run, BULK_NICE, NICEST};

    #[tokio::test]
    async fn runs_the_job_at_a_lower_priority_and_survives_its_panic() {
        let expected = (nice_now() + BULK_NICE).min(NICEST);
        assert_eq!(run(nice_now).await, Some(expected));
        // The caller keeps its own priority.
        assert!(nice_now() < expected || expected == NICEST);
        let panicked: Option<()> = run(|| panic!("a job that panics")).await;
        assert_eq!(panicked, None);
    }
}
