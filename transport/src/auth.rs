//! Proving that a peer may talk to us: a shared [`Token`] that never crosses the wire, and the
//! randomness behind nonces and unguessable registration keys.
//!
//! Every plane that authenticates (the shm and tcp engines' handshakes, the storage unit's
//! control session) does it the same way: each side sends a fresh random [`Nonce`], and each
//! proves it holds the token with an HMAC-SHA256 ([`Token::mac`]) over a label naming its role
//! and everything the exchange said (both nonces, the names and addresses it claims). A
//! recorded exchange replays nowhere: the other side's nonce is new every time. Without a
//! token, the engines fall back to the peer's user id (`SO_PEERCRED`) and local sockets; see
//! the crate README's trust model.
//!
//! HMAC and SHA-256 come from the RustCrypto crates (`hmac`, `sha2`), whose `verify_slice`
//! compares in constant time; randomness from `getrandom` (the kernel's `getrandom(2)`):
//! nonces straight from it, the many registration keys a busy agent draws (one per frame
//! registered in place) from a ChaCha12 stream per thread (`rand_chacha`) that the kernel
//! seeds, and reseeds in a forked child, so that no key costs a system call.

use std::fmt;
use std::path::Path;

use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::sync::Arc;

/// Bytes of a [`Nonce`].
pub const NONCE_LEN: usize = 32;
/// Bytes of a proof ([`Token::mac`]).
pub const MAC_LEN: usize = 32;

/// A fresh random challenge.
pub type Nonce = [u8; NONCE_LEN];
/// An HMAC-SHA256 proof.
pub type Proof = [u8; MAC_LEN];

/// A shared secret: peers holding the same token may reach each other. Its bytes are never
/// printed (`Debug` shows `Token(<redacted>)`) and never sent: only proofs over it are.
#[derive(Clone)]
pub struct Token(Arc<[u8]>);

/// A token that cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TokenError {
    /// The secret is empty (after trimming a trailing newline, for files and variables).
    #[error("the token {source_name} is empty")]
    Empty {
        /// Where it came from.
        source_name: String,
    },
    /// The token file could not be read.
    #[error("reading the token file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The token file can be read or written by other users.
    #[error(
        "the token file {path} is accessible to other users (mode {mode:o}); \
         `chmod 600` it or use TESSERA_TOKEN"
    )]
    Exposed {
        /// The file.
        path: String,
        /// Its permission bits.
        mode: u32,
    },
}

impl Token {
    /// A token of these bytes.
    pub fn new(secret: impl AsRef<[u8]>) -> Result<Self, TokenError> {
        Self::named(secret.as_ref(), "given")
    }

    fn named(secret: &[u8], source_name: &str) -> Result<Self, TokenError> {
        if secret.is_empty() {
            return Err(TokenError::Empty {
                source_name: source_name.to_owned(),
            });
        }
        Ok(Self(Arc::from(secret)))
    }

    /// The token in file `path`, without its trailing newline. Refused when the file's mode
    /// lets group or others read or write it.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, TokenError> {
        use std::os::unix::fs::PermissionsExt;
        let path = path.as_ref();
        let shown = path.display().to_string();
        let read = |source| TokenError::Read {
            path: shown.clone(),
            source,
        };
        let mode = std::fs::metadata(path).map_err(read)?.permissions().mode();
        if mode & 0o077 != 0 {
            return Err(TokenError::Exposed {
                path: shown,
                mode: mode & 0o7777,
            });
        }
        let bytes = std::fs::read(path).map_err(read)?;
        Self::named(trim_newline(&bytes), &format!("file {shown}"))
    }

    /// The token in environment variable `var`, if it is set.
    pub fn from_env(var: &str) -> Result<Option<Self>, TokenError> {
        use std::os::unix::ffi::OsStrExt;
        match std::env::var_os(var) {
            None => Ok(None),
            Some(v) => {
                Self::named(trim_newline(v.as_bytes()), &format!("variable {var}")).map(Some)
            }
        }
    }

    /// HMAC-SHA256 under this token of `label` and `parts`, each length-prefixed so that no
    /// two different lists of parts give the same input.
    pub fn mac(&self, label: &str, parts: &[&[u8]]) -> Proof {
        mac_with(&self.0, label, parts)
    }

    /// Whether `proof` is [`Token::mac`] of `label` and `parts`, compared in constant time.
    pub fn verify(&self, label: &str, parts: &[&[u8]], proof: &[u8]) -> bool {
        hmac_of(&self.0, label, parts).verify_slice(proof).is_ok()
    }
}

impl PartialEq for Token {
    /// Constant-time in the secret's bytes.
    fn eq(&self, other: &Self) -> bool {
        let nonce = nonce();
        other.verify(
            "tessera-token-eq",
            &[&nonce],
            &self.mac("tessera-token-eq", &[&nonce]),
        )
    }
}

impl Eq for Token {}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

impl std::str::FromStr for Token {
    type Err = TokenError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::new(s)
    }
}

fn trim_newline(b: &[u8]) -> &[u8] {
    let b = b.strip_suffix(b"\n").unwrap_or(b);
    b.strip_suffix(b"\r").unwrap_or(b)
}

fn hmac_of(key: &[u8], label: &str, parts: &[&[u8]]) -> Hmac<Sha256> {
    // HMAC takes keys of any length; `new_from_slice` cannot fail for it.
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC accepts any key length");
    for p in std::iter::once(label.as_bytes()).chain(parts.iter().copied()) {
        m.update(&(p.len() as u64).to_le_bytes());
        m.update(p);
    }
    m
}

fn mac_with(key: &[u8], label: &str, parts: &[&[u8]]) -> Proof {
    hmac_of(key, label, parts).finalize().into_bytes().into()
}

/// A proof under `token`, or under the empty key without one: the handshake keeps one shape
/// whether or not a token is configured (without one, the proof binds the exchange but proves
/// nothing, and the engines check the peer's user id instead).
pub fn prove(token: Option<&Token>, label: &str, parts: &[&[u8]]) -> Proof {
    match token {
        Some(t) => t.mac(label, parts),
        None => mac_with(&[], label, parts),
    }
}

/// Whether `proof` is [`prove`]'s for the same arguments (constant time).
pub fn check(token: Option<&Token>, label: &str, parts: &[&[u8]], proof: &[u8]) -> bool {
    match token {
        Some(t) => t.verify(label, parts, proof),
        None => hmac_of(&[], label, parts).verify_slice(proof).is_ok(),
    }
}

/// Fills `buf` from the kernel's random source. Failing that (no `getrandom(2)` and no
/// `/dev/urandom`), nothing secure can be done, so it panics with the reason.
pub fn fill_random(buf: &mut [u8]) {
    getrandom::fill(buf).expect("the kernel's random source is unavailable");
}

/// A fresh nonce.
pub fn nonce() -> Nonce {
    let mut n = [0u8; NONCE_LEN];
    fill_random(&mut n);
    n
}

/// A random, non-zero 64-bit number: registration keys and other identifiers a peer must not
/// guess. Drawn from a cryptographic stream per thread (ChaCha12) seeded from the kernel's
/// source; a forked child reseeds before its first draw, so parent and child never share a
/// stream.
pub fn random_u64() -> u64 {
    use rand_core::{RngCore, SeedableRng};
    use std::cell::RefCell;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Once;

    /// Bumped in every forked child (`pthread_atfork`): a stream seeded before is stale there.
    static FORKS: AtomicU64 = AtomicU64::new(0);
    static HOOK: Once = Once::new();
    extern "C" fn forked() {
        FORKS.fetch_add(1, Ordering::Relaxed);
    }
    thread_local! {
        static STREAM: RefCell<Option<(u64, rand_chacha::ChaCha12Rng)>> =
            const { RefCell::new(None) };
    }
    HOOK.call_once(|| {
        // SAFETY: registers a handler that only bumps an atomic, which is async-signal-safe as
        // a child handler must be; the function pointer lives for the whole program.
        unsafe { libc::pthread_atfork(None, None, Some(forked)) };
    });
    STREAM.with(|s| {
        let mut s = s.borrow_mut();
        let generation = FORKS.load(Ordering::Relaxed);
        let rng = match &mut *s {
            Some((g, rng)) if *g == generation => rng,
            slot => {
                let mut seed = [0u8; 32];
                fill_random(&mut seed);
                let fresh = rand_chacha::ChaCha12Rng::from_seed(seed);
                &mut slot.insert((generation, fresh)).1
            }
        };
        loop {
            let v = rng.next_u64();
            if v != 0 {
                return v;
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_bind_the_token_the_label_and_every_part() {
        let t = Token::new("secret").unwrap();
        let p = t.mac("hello", &[b"ab", b"c"]);
        assert!(t.verify("hello", &[b"ab", b"c"], &p));
        assert!(
            !t.verify("hello", &[b"a", b"bc"], &p),
            "parts are length-prefixed"
        );
        assert!(!t.verify("other", &[b"ab", b"c"], &p));
        assert!(!Token::new("secreT")
            .unwrap()
            .verify("hello", &[b"ab", b"c"], &p));
        assert!(!t.verify("hello", &[b"ab", b"c"], &p[..31]));
        assert!(check(Some(&t), "hello", &[b"ab", b"c"], &p));
        assert!(!check(None, "hello", &[b"ab", b"c"], &p));
        assert!(check(None, "x", &[], &prove(None, "x", &[])));
        assert_eq!(t, Token::new("secret").unwrap());
        assert_ne!(t, Token::new("secret2").unwrap());
    }

    /// A child forked after its parent drew keys draws its own, not the parent's next ones.
    #[test]
    fn a_forked_child_draws_keys_of_its_own() {
        let _ = random_u64();
        let mut fds = [0i32; 2];
        // SAFETY: `fds` has room for the two descriptors pipe(2) writes.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: the child only draws a key, writes it to the pipe and leaves with _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            let v = random_u64().to_le_bytes();
            // SAFETY: writes the 8 bytes of `v` to the pipe's write end, then ends the child
            // without running the parent's destructors.
            unsafe {
                libc::write(fds[1], v.as_ptr().cast(), v.len());
                libc::_exit(0);
            }
        }
        let mut b = [0u8; 8];
        // SAFETY: reads at most 8 bytes into `b`; waits for the child it forked.
        let n = unsafe {
            libc::close(fds[1]);
            let n = libc::read(fds[0], b.as_mut_ptr().cast(), b.len());
            libc::close(fds[0]);
            libc::waitpid(pid, std::ptr::null_mut(), 0);
            n
        };
        assert_eq!(n, 8);
        assert_ne!(u64::from_le_bytes(b), random_u64());
    }

    #[test]
    fn tokens_are_never_printed_and_never_empty() {
        let t = Token::new("hunter2").unwrap();
        assert_eq!(format!("{t:?}"), "Token(<redacted>)");
        assert!(matches!(Token::new(""), Err(TokenError::Empty { .. })));
    }

    #[test]
    fn token_files_trim_one_newline_and_must_be_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("tessera-token-{}", random_u64()));
        std::fs::create_dir(&dir).unwrap();
        let path = dir.join("token");
        std::fs::write(&path, "s3cret\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let err = Token::from_file(&path).unwrap_err();
        assert!(
            matches!(err, TokenError::Exposed { mode: 0o644, .. }),
            "{err}"
        );
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(
            Token::from_file(&path).unwrap(),
            Token::new("s3cret").unwrap()
        );
        std::fs::write(&path, "\n").unwrap();
        assert!(matches!(
            Token::from_file(&path),
            Err(TokenError::Empty { .. })
        ));
        assert!(matches!(
            Token::from_file(dir.join("missing")),
            Err(TokenError::Read { .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn random_numbers_differ() {
        assert_ne!(nonce(), nonce());
        assert_ne!(random_u64(), random_u64());
    }
}
