//! A private etcd server for tests: Debian's `etcd` (or `$TESSERA_ETCD`) on two loopback
//! ports, with a temporary data directory, stopped by its pid when dropped.

use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running etcd of one member.
#[derive(Debug)]
pub struct Etcd {
    child: Option<Child>,
    client: SocketAddr,
    peer: SocketAddr,
    dir: tempfile::TempDir,
    host: String,
}

/// The etcd binary: `$TESSERA_ETCD`, else `etcd` on the `PATH`.
pub fn etcd_binary() -> PathBuf {
    std::env::var_os("TESSERA_ETCD").map_or_else(|| "etcd".into(), PathBuf::from)
}

/// Whether an etcd binary can be run here.
pub fn available() -> bool {
    Command::new(etcd_binary())
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn free_port(host: &str) -> io::Result<SocketAddr> {
    TcpListener::bind((host, 0))?.local_addr()
}

impl Etcd {
    /// Starts etcd on two free ports of 127.0.0.1 and waits until it serves.
    pub fn start() -> io::Result<Self> {
        Self::start_on("127.0.0.1")
    }

    /// Starts etcd on two free ports of `host` (an address of this machine) and waits until
    /// it serves.
    pub fn start_on(host: &str) -> io::Result<Self> {
        let mut etcd = Self {
            child: None,
            client: free_port(host)?,
            peer: free_port(host)?,
            dir: tempfile::tempdir()?,
            host: host.to_owned(),
        };
        etcd.resume()?;
        Ok(etcd)
    }

    /// Its client URL (`http://HOST:PORT`).
    pub fn url(&self) -> String {
        format!("http://{}", self.client)
    }

    /// Its pid, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Stops it (SIGTERM, then SIGKILL after 5 s) and waits for it; its data stays for
    /// [`resume`](Self::resume).
    pub fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        // SAFETY: kill(2) takes no pointers; the pid is a child this value spawned and has
        // not reaped, so it names no other process.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
    }

    /// Starts it again on the same ports and data (after [`stop`](Self::stop)) and waits
    /// until it serves.
    pub fn resume(&mut self) -> io::Result<()> {
        if self.child.is_some() {
            return Ok(());
        }
        let client = format!("http://{}", self.client);
        let peer = format!("http://{}", self.peer);
        let log = std::fs::File::create(self.dir.path().join("etcd.log"))?;
        let child = Command::new(etcd_binary())
            .args(["--name", "tessera-test"])
            .arg("--data-dir")
            .arg(self.dir.path().join("data"))
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("tessera-test={peer}")])
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .map_err(|e| io::Error::new(e.kind(), format!("running {:?}: {e}", etcd_binary())))?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                self.child = None;
                let log =
                    std::fs::read_to_string(self.dir.path().join("etcd.log")).unwrap_or_default();
                return Err(io::Error::other(format!(
                    "etcd on {} exited with {status}: {}",
                    self.host,
                    log.lines().rev().take(5).collect::<Vec<_>>().join(" | ")
                )));
            }
            if self.healthy() {
                return Ok(());
            }
            if Instant::now() > deadline {
                self.stop();
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "etcd did not become healthy within 20 s",
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Whether `/health` answers that it is (a leader elected, the store serving).
    fn healthy(&self) -> bool {
        use std::io::{Read, Write};
        let Ok(mut s) = TcpStream::connect_timeout(&self.client, Duration::from_millis(200)) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
        let req = format!(
            "GET /health HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
            self.client
        );
        if s.write_all(req.as_bytes()).is_err() {
            return false;
        }
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        out.contains("\"health\":\"true\"")
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.stop();
    }
}
