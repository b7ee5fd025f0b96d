//! The mutual challenge-response both socket engines (`shm`, `tcp`) run before anything else
//! on a connection, and the limits on a peer that has not proved itself yet.
//!
//! 1. dialer → target: `HELLO` with a fresh nonce, the dialer's name and address;
//! 2. target → dialer: `CHALLENGE` with its own nonce and its proof (label `<engine> target`,
//!    over both nonces and the target's name);
//! 3. the dialer checks the proof, then sends `AUTH` with its proof (label `<engine> dialer`,
//!    over both nonces, its name and address);
//! 4. the target checks it and the name claim, and answers `HELLO_ACK` or `REFUSED`.
//!
//! Without a token both proofs are made under the empty key (they bind the exchange but prove
//! nothing) and each side checks the other's user id instead (`SO_PEERCRED` on `shm`,
//! `/proc/net/tcp` on `tcp` over loopback).

use std::time::Duration;

use crate::auth::{self, Nonce, Proof, Token};

/// Most bytes a peer may send before it has authenticated.
pub(crate) const PRE_AUTH_MAX: usize = 4096;
/// How long a peer may take to authenticate once connected.
pub(crate) const PRE_AUTH_DEADLINE: Duration = Duration::from_secs(5);

/// Why a target refused a handshake, as `REFUSED` carries it.
pub(crate) const REFUSED_PROOF: u8 = 1;
pub(crate) const REFUSED_NAME_IN_USE: u8 = 2;
pub(crate) const REFUSED_UID: u8 = 3;

pub(crate) fn target_proof(
    token: Option<&Token>,
    engine: &str,
    dialer_nonce: &Nonce,
    target_nonce: &Nonce,
    target_name: &str,
) -> Proof {
    auth::prove(
        token,
        &format!("tessera-{engine} target"),
        &[dialer_nonce, target_nonce, target_name.as_bytes()],
    )
}

pub(crate) fn check_target(
    token: Option<&Token>,
    engine: &str,
    dialer_nonce: &Nonce,
    target_nonce: &Nonce,
    target_name: &str,
    proof: &[u8],
) -> bool {
    auth::check(
        token,
        &format!("tessera-{engine} target"),
        &[dialer_nonce, target_nonce, target_name.as_bytes()],
        proof,
    )
}

pub(crate) fn dialer_proof(
    token: Option<&Token>,
    engine: &str,
    dialer_nonce: &Nonce,
    target_nonce: &Nonce,
    name: &str,
    address: &[u8],
) -> Proof {
    auth::prove(
        token,
        &format!("tessera-{engine} dialer"),
        &[dialer_nonce, target_nonce, name.as_bytes(), address],
    )
}

pub(crate) fn check_dialer(
    token: Option<&Token>,
    engine: &str,
    dialer_nonce: &Nonce,
    target_nonce: &Nonce,
    name: &str,
    address: &[u8],
    proof: &[u8],
) -> bool {
    auth::check(
        token,
        &format!("tessera-{engine} dialer"),
        &[dialer_nonce, target_nonce, name.as_bytes(), address],
        proof,
    )
}

/// What a dialer reports when the target's proof does not verify.
pub(crate) fn bad_target_proof(peer: &str, token: Option<&Token>) -> String {
    let ours = if token.is_some() { "ours" } else { "none" };
    format!(
        "{peer}'s proof does not match our token ({ours}): the tokens differ, or one side has \
         none"
    )
}

/// What a dialer reports for a target's `REFUSED`.
pub(crate) fn refused(peer: &str, me: &str, code: u8) -> String {
    match code {
        REFUSED_PROOF => {
            format!("{peer} refused our proof: the tokens differ, or one side has none")
        }
        REFUSED_NAME_IN_USE => format!(
            "{peer} refused us: name in use (it has a live link from another agent named {me:?})"
        ),
        REFUSED_UID => {
            format!("{peer} refused us: we run as another user and no token is configured")
        }
        _ => format!("{peer} refused the handshake"),
    }
}

/// The effective user id of this process.
pub(crate) fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// The process id and user id of the process at the other end of a Unix socket.
pub(crate) fn unix_peer_cred(fd: std::os::fd::RawFd) -> std::io::Result<(i32, u32)> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `fd` is an open socket; `cred` and `len` are writable, live across the call,
    // and `len` holds `cred`'s size.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok((cred.pid, cred.uid))
}

/// The user id owning the TCP socket on this host whose local end is `local` and whose
/// remote end is `remote` (`/proc/net/tcp` or `/proc/net/tcp6`), if there is one.
pub(crate) fn tcp_socket_uid(
    local: std::net::SocketAddr,
    remote: std::net::SocketAddr,
) -> Option<u32> {
    use std::net::IpAddr;
    fn hex(ip: IpAddr, port: u16) -> String {
        match ip {
            IpAddr::V4(v4) => format!("{:08X}:{port:04X}", u32::from_ne_bytes(v4.octets())),
            IpAddr::V6(v6) => {
                let o = v6.octets();
                let words: String = o
                    .chunks(4)
                    .map(|c| format!("{:08X}", u32::from_ne_bytes([c[0], c[1], c[2], c[3]])))
                    .collect();
                format!("{words}:{port:04X}")
            }
        }
    }
    let mut wanted = vec![(
        hex(local.ip(), local.port()),
        hex(remote.ip(), remote.port()),
    )];
    // A dual-stack socket lists IPv4 peers as IPv4-mapped IPv6 addresses.
    let mapped = |ip: IpAddr| match ip {
        IpAddr::V4(v4) => IpAddr::V6(v4.to_ipv6_mapped()),
        IpAddr::V6(v6) => IpAddr::V6(v6),
    };
    wanted.push((
        hex(mapped(local.ip()), local.port()),
        hex(mapped(remote.ip()), remote.port()),
    ));
    for file in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(file) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 8 {
                continue;
            }
            if wanted.iter().any(|(l, r)| f[1] == l && f[2] == r) {
                return f[7].parse().ok();
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each `REFUSED` code tells the dialer its own reason; a code it does not know, only that
    /// the handshake was refused.
    #[test]
    fn each_refusal_code_names_its_reason() {
        assert_eq!(
            refused("t", "me", REFUSED_PROOF),
            "t refused our proof: the tokens differ, or one side has none"
        );
        assert_eq!(
            refused("t", "me", REFUSED_NAME_IN_USE),
            "t refused us: name in use (it has a live link from another agent named \"me\")"
        );
        assert_eq!(
            refused("t", "me", REFUSED_UID),
            "t refused us: we run as another user and no token is configured"
        );
        assert_eq!(refused("t", "me", 0), "t refused the handshake");
        assert_eq!(refused("t", "me", 200), "t refused the handshake");
    }

    /// A dialer whose check of the target's proof failed says whether it has a token.
    #[test]
    fn a_bad_target_proof_says_whether_we_have_a_token() {
        let token = Token::new("a secret").unwrap();
        assert_eq!(
            bad_target_proof("t", Some(&token)),
            "t's proof does not match our token (ours): the tokens differ, or one side has none"
        );
        assert_eq!(
            bad_target_proof("t", None),
            "t's proof does not match our token (none): the tokens differ, or one side has none"
        );
    }
}
