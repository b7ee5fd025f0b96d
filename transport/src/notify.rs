//! Notifications from peers, queued until the agent takes them.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use tessera_sync::{Condvar, Mutex};

/// Largest notification, in bytes.
pub const MAX_NOTIFICATION: usize = 64 * 1024;

/// A notification from a peer, delivered after the data of its transfer landed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notification {
    /// The sending agent's name.
    pub from: String,
    /// The message.
    pub msg: Vec<u8>,
}

#[derive(Default)]
pub(crate) struct Notifications {
    queue: Mutex<(VecDeque<Notification>, Vec<Waker>)>,
    ready: Condvar,
}

impl Notifications {
    pub(crate) fn push(&self, from: String, msg: Vec<u8>) {
        let wakers = {
            let mut q = self.queue.lock();
            q.0.push_back(Notification { from, msg });
            std::mem::take(&mut q.1)
        };
        self.ready.notify_all();
        for w in wakers {
            w.wake();
        }
    }

    pub(crate) fn try_pop(&self) -> Option<Notification> {
        self.queue.lock().0.pop_front()
    }

    pub(crate) fn wait(&self, timeout: Duration) -> Option<Notification> {
        let deadline = Instant::now() + timeout;
        let mut q = self.queue.lock();
        loop {
            if let Some(n) = q.0.pop_front() {
                return Some(n);
            }
            let left = deadline.checked_duration_since(Instant::now())?;
            q = self.ready.wait_timeout(q, left).0;
        }
    }
}

/// Future of [`Agent::next_notification`](crate::Agent::next_notification).
#[must_use = "futures do nothing unless polled"]
pub struct NextNotification<'a> {
    pub(crate) queue: &'a Notifications,
}

impl Future for NextNotification<'_> {
    type Output = Notification;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Notification> {
        let mut q = self.queue.queue.lock();
        match q.0.pop_front() {
            Some(n) => Poll::Ready(n),
            None => {
                if !q.1.iter().any(|w| w.will_wake(cx.waker())) {
                    q.1.push(cx.waker().clone());
                }
                Poll::Pending
            }
        }
    }
}
