//! Helpers shared by the two-process bandwidth examples (`ucx_put_bw`, `nixl_write_bw`,
//! `ucx_agent_bw`, `nixl_agent_bw`): pin a process to a core, and pass bytes as hex over the
//! target's stdout. The `Agent`-level runner is `agent.rs` beside this file.

/// Pins this process to `cpu`.
pub(crate) fn pin(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET writes inside it; the call
    // only reads the set.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set);
    }
}

/// `bytes` as lowercase hex.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The bytes of a hex string (a bad pair reads as 0).
pub(crate) fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap_or(0))
        .collect()
}
