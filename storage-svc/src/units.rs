//! Sizes and durations as people write them, in flags and configuration files alike.
//!
//! A size is a whole number of bytes or a number with a unit: `K`, `M`, `G`, `T` (and `KB` ..
//! `TB`) are powers of 1000, `Ki`, `Mi`, `Gi`, `Ti` (and `KiB` .. `TiB`) powers of 1024, case
//! ignored (`bytesize`'s syntax). A duration has a unit: `30s`, `500ms`, `2m`, `1s 500ms`
//! (`humantime`'s). Configuration files print sizes with the unit that divides them exactly
//! (`"256MiB"`, `"2GB"`) and durations as `"30s"`, so every figure reads back to what it was.

use std::time::Duration;

/// Parses a size (`1G`, `512MiB`, `4096`) into bytes.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    if t.starts_with('-') {
        return Err(format!("{s:?} is negative: a size is 0 or more bytes"));
    }
    t.parse::<bytesize::ByteSize>().map(|b| b.0).map_err(|_| {
        format!(
            "{s:?} is not a size: give bytes (4096) or a number with a unit, \
             K M G T (powers of 1000) or KiB MiB GiB TiB (powers of 1024)"
        )
    })
}

/// Parses a duration with its unit (`30s`, `500ms`, `2m`).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    if !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return Err(format!(
            "{s:?} has no unit: write it as \"{t}s\" or \"{t}ms\""
        ));
    }
    humantime::parse_duration(t).map_err(|e| {
        format!("{s:?} is not a duration ({e}): give a number with a unit, as 30s, 500ms or 2m")
    })
}

/// A size for people to read, with a binary unit: `1.00 GiB`, `512 B`.
pub fn fmt_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

/// The exact spelling of `b` that configuration files use: of the units that divide it,
/// binary or decimal, the one that leaves the smallest number (`"256MiB"`, `"2GB"`); else the
/// plain number.
fn exact_size(b: u64) -> Option<String> {
    const UNITS: [(u64, &str); 8] = [
        (1 << 40, "TiB"),
        (1_000_000_000_000, "TB"),
        (1 << 30, "GiB"),
        (1_000_000_000, "GB"),
        (1 << 20, "MiB"),
        (1_000_000, "MB"),
        (1 << 10, "KiB"),
        (1_000, "KB"),
    ];
    UNITS
        .iter()
        .filter(|(unit, _)| b != 0 && b % unit == 0)
        .min_by_key(|(unit, _)| b / unit)
        .map(|(unit, name)| format!("{}{name}", b / unit))
}

/// `#[serde(with = "crate::units::size")]`: a byte count, read as a number or a size string,
/// written with the unit that divides it exactly where one does.
pub(crate) mod size {
    use serde::{de, Deserialize, Deserializer, Serializer};

    pub(crate) fn serialize<S: Serializer>(b: &u64, s: S) -> Result<S::Ok, S::Error> {
        match super::exact_size(*b) {
            Some(text) if s.is_human_readable() => s.serialize_str(&text),
            _ => s.serialize_u64(*b),
        }
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Bytes(u64),
            Text(String),
        }
        match Raw::deserialize(d) {
            Ok(Raw::Bytes(b)) => Ok(b),
            Ok(Raw::Text(t)) => super::parse_size(&t).map_err(de::Error::custom),
            Err(_) => Err(de::Error::custom(
                "expected a size: bytes (4096) or a string with a unit (\"1GiB\", \"512M\")",
            )),
        }
    }
}

/// `#[serde(with = "crate::units::duration")]`: a duration written and read as a string with
/// its unit (`"30s"`, `"500ms"`).
pub(crate) mod duration {
    use serde::{de, Deserialize, Deserializer, Serializer};
    use std::time::Duration;

    pub(crate) fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&humantime::format_duration(*d).to_string())
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Text(String),
            Number(f64),
        }
        match Raw::deserialize(d) {
            Ok(Raw::Text(t)) => super::parse_duration(&t).map_err(de::Error::custom),
            Ok(Raw::Number(n)) => Err(de::Error::custom(format!(
                "a duration takes a unit: write \"{n}s\" or \"{n}ms\""
            ))),
            Err(_) => Err(de::Error::custom(
                "expected a duration with its unit, as \"30s\" or \"500ms\"",
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_as_people_write_them() {
        for (text, bytes) in [
            ("4096", 4096),
            ("1K", 1000),
            ("1KiB", 1024),
            ("1Ki", 1024),
            ("1G", 1_000_000_000),
            ("1g", 1_000_000_000),
            ("1GiB", 1 << 30),
            ("256 MiB", 256 << 20),
            ("2T", 2_000_000_000_000),
            ("1TiB", 1 << 40),
        ] {
            assert_eq!(parse_size(text), Ok(bytes), "{text}");
        }
        for bad in ["", "-1", "1X", "G", "1 GiB extra"] {
            let e = parse_size(bad).unwrap_err();
            assert!(e.contains(&format!("{bad:?}")), "{e}");
        }
    }

    #[test]
    fn durations_need_their_unit() {
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("1s 500ms"), Ok(Duration::from_millis(1500)));
        assert!(parse_duration("30").unwrap_err().contains("\"30s\""));
        assert!(parse_duration("soon").is_err());
    }

    #[test]
    fn configuration_files_spell_sizes_exactly() {
        assert_eq!(exact_size(1 << 30).as_deref(), Some("1GiB"));
        assert_eq!(exact_size(3 << 20).as_deref(), Some("3MiB"));
        assert_eq!(exact_size(3072).as_deref(), Some("3KiB"));
        assert_eq!(exact_size(2_000_000_000).as_deref(), Some("2GB"));
        assert_eq!(exact_size(1000).as_deref(), Some("1KB"));
        assert_eq!(exact_size(1536), None);
        assert_eq!(exact_size(12345), None);
        assert_eq!(exact_size(0), None);
        for b in [
            0u64,
            64,
            1000,
            1536,
            2_000_000_000,
            1 << 30,
            (1 << 40) * 3,
            u64::MAX,
        ] {
            let text = exact_size(b).unwrap_or_else(|| b.to_string());
            assert_eq!(parse_size(&text), Ok(b), "{text}");
        }
    }

    #[test]
    fn bytes_for_people() {
        assert_eq!(fmt_bytes(0), "0 B");
        assert_eq!(fmt_bytes(1023), "1023 B");
        assert_eq!(fmt_bytes(3 << 19), "1.50 MiB");
        assert_eq!(fmt_bytes(512), "512 B");
        assert_eq!(fmt_bytes(1 << 30), "1.00 GiB");
        assert_eq!(fmt_bytes(1536), "1.50 KiB");
    }
}
