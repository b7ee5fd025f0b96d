//! Golden vectors: the exact bytes of a few encodings, kept under `tests/vectors/`. A change of
//! the wire format fails this test; rerun with `TESSERA_BLESS=1` to accept it deliberately (and
//! bump the version in `WIRE.md` when old decoders cannot read the new bytes).

use std::fmt::Write as _;
use std::path::PathBuf;

use bytes::Bytes;
use tessera_framecodec::{decode, DType, Encoder, Frames, Tensor, Value};

fn vectors() -> Vec<(&'static str, Encoder, Value)> {
    let scalars = Value::map([
        ("null", Value::Null),
        ("yes", Value::Bool(true)),
        ("neg", Value::I64(-2)),
        ("big", Value::U64(u64::MAX)),
        ("f", Value::F64(0.5)),
        ("s", Value::from("héllo")),
        ("empty", Value::List(vec![])),
        ("map", Value::Map(vec![])),
    ]);
    let all_dtypes = Value::List(
        DType::ALL
            .iter()
            .map(|&d| {
                let data: Vec<u8> = (0..2 * d.size() as u8).map(|b| b & 1).collect();
                Tensor::new(d, &[2], Bytes::from(data)).unwrap().into()
            })
            .collect(),
    );
    let base: Vec<u8> = (0..24).collect();
    let frames = Value::map([
        // The transpose of a 2x3 u32 matrix: strided, in its own frame.
        (
            "t",
            Tensor::with_strides(DType::U32, &[3, 2], &[1, 3], Bytes::from(base.clone()))
                .unwrap()
                .into(),
        ),
        ("raw", Value::Bytes(Bytes::from(base))),
        ("tiny", Tensor::from_slice(&[1], &[7u16]).unwrap().into()),
        (
            "none",
            Tensor::new(DType::F64, &[0, 3], Bytes::new())
                .unwrap()
                .into(),
        ),
        ("nothing", Value::Bytes(Bytes::new())),
    ]);
    let batch: Vec<f32> = (0..8).map(|i| i as f32 / 2.0).collect();
    let nested = Value::List(vec![Value::map([
        (
            "sample",
            Value::map([
                ("x", Tensor::from_slice(&[2, 4], &batch).unwrap().into()),
                ("meta", Value::List(vec![Value::I64(1), Value::from("a")])),
            ]),
        ),
        (
            "scalar",
            Tensor::from_slice(&[], &[[1.0f32, -1.0]]).unwrap().into(),
        ),
    ])]);
    // Every length and integer class the writer picks beyond the fix forms: array16, map16,
    // str8, uint 8/32/64, int 8/32/64.
    let widths = Value::map([
        ("long", Value::List((0..20u64).map(Value::U64).collect())),
        (
            "wide",
            Value::Map(
                (0..17)
                    .map(|i| (format!("k{i}"), Value::I64(-i * 1000)))
                    .collect(),
            ),
        ),
        ("name", Value::from("x".repeat(40).as_str())),
        ("u8", Value::U64(200)),
        ("u32", Value::U64(70_000)),
        ("i8", Value::I64(-100)),
        ("i32", Value::I64(70_000)),
        ("i64", Value::I64(i64::MIN)),
        ("no", Value::Bool(false)),
        (
            "big",
            Tensor::new(DType::U8, &[300], Bytes::from(vec![9u8; 300]))
                .unwrap()
                .into(),
        ),
    ]);
    // Runs: four 16-byte tensors in frames of their own, five 2-byte ones packed at a stride
    // of 2 after a 1-byte string.
    let runs = Value::map([
        (
            "framed",
            Value::List(
                (0..4u8)
                    .map(|i| Tensor::from_slice(&[2, 2], &[i as f32; 4]).unwrap().into())
                    .collect(),
            ),
        ),
        ("s", Value::Bytes(Bytes::from_static(b"!"))),
        (
            "packed",
            Value::List(
                (0..5u16)
                    .map(|i| Tensor::from_slice(&[1], &[i]).unwrap().into())
                    .collect(),
            ),
        ),
    ]);
    vec![
        ("runs", Encoder::new().pack_below(16), runs),
        ("scalars", Encoder::new(), scalars),
        ("widths", Encoder::new().pack_below(0), widths),
        ("all_dtypes", Encoder::new(), all_dtypes),
        ("frames", Encoder::new().pack_below(16), frames),
        ("nested", Encoder::new(), nested),
    ]
}

fn hex_lines(out: &mut String, bytes: &[u8]) {
    for chunk in bytes.chunks(32) {
        for b in chunk {
            write!(out, "{b:02x}").unwrap();
        }
        out.push('\n');
    }
}

fn render(frames: &Frames) -> String {
    let mut out = String::from("meta\n");
    hex_lines(&mut out, &frames.meta);
    for (i, p) in frames.payloads.iter().enumerate() {
        writeln!(out, "frame {i}").unwrap();
        hex_lines(&mut out, p);
    }
    out
}

/// Reads a rendered vector back into its meta frame and payload frames.
fn parse(text: &str) -> (Vec<u8>, Vec<Bytes>) {
    let mut parts: Vec<Vec<u8>> = Vec::new();
    for line in text.lines() {
        if line == "meta" || line.starts_with("frame ") {
            parts.push(Vec::new());
            continue;
        }
        let part = parts.last_mut().expect("a vector starts with `meta`");
        for i in (0..line.len()).step_by(2) {
            part.push(u8::from_str_radix(&line[i..i + 2], 16).expect("hex"));
        }
    }
    let meta = parts.remove(0);
    (meta, parts.into_iter().map(Bytes::from).collect())
}

#[test]
fn golden_vectors_match_and_decode() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/vectors");
    let bless = std::env::var_os("TESSERA_BLESS").is_some_and(|v| v == "1");
    let mut stale = Vec::new();
    for (name, encoder, value) in vectors() {
        let path = dir.join(format!("{name}.hex"));
        let rendered = render(&encoder.encode(&value).unwrap());
        if bless {
            std::fs::write(&path, &rendered).unwrap();
        }
        let stored = std::fs::read_to_string(&path).unwrap_or_default();
        if stored != rendered {
            stale.push(name);
            continue;
        }
        // The stored bytes decode to the value, independently of the encoder.
        let (meta, frames) = parse(&stored);
        assert_eq!(decode(&meta, &frames).unwrap(), value, "vector {name}");
    }
    assert!(
        stale.is_empty(),
        "the encoding of {stale:?} differs from tests/vectors/: if the wire format change is \
         deliberate, rerun with TESSERA_BLESS=1 and document it in WIRE.md"
    );
}
