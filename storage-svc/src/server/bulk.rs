//! A request's bulk work (the decode of a request of megabytes: a GET of a million keys) on a
//! thread of its own at a lower scheduling priority. The unit's workers serve every
//! session's small requests on the same cores; at equal priority a worker woken by one waits
//! for the bulk thread's time slice to end (milliseconds), at a lower one it preempts it at
//! once. A session runs one request at a time, so it has at most one such thread.

use tessera_transport::priority;

/// How much nicer a bulk thread is than the thread that starts it (the workers keep the
/// process's own priority).
const BULK_NICE: i32 = 10;

/// Runs `job` on a new thread [`BULK_NICE`] nicer than the caller and waits for it; on the blocking pool at
/// the process's priority where no thread can be started. `None` if the job panicked.
pub(super) async fn run<T, F>(job: F) -> Option<T>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    let (job_tx, job_rx) = std::sync::mpsc::channel::<F>();
    let spawned = std::thread::Builder::new()
        .name("tessera-bulk".into())
        .spawn(move || {
            // A new thread starts at its creator's priority.
            if !priority::lower_priority(BULK_NICE) {
                tracing::debug!(
                    error = %std::io::Error::last_os_error(),
                    "a bulk thread keeps the process's priority"
                );
            }
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

#[cfg(test)]
mod tests {
    use super::{run, BULK_NICE};
    use tessera_transport::priority::{nice, NICEST};

    #[tokio::test]
    async fn runs_the_job_at_a_lower_priority_and_survives_its_panic() {
        let expected = (nice() + BULK_NICE).min(NICEST);
        assert_eq!(run(nice).await, Some(expected));
        // The caller keeps its own priority.
        assert!(nice() < expected || expected == NICEST);
        let panicked: Option<()> = run(|| panic!("a job that panics")).await;
        assert_eq!(panicked, None);
    }
}
