//! tessera-framecodec: encode plus decode of one 256 MiB tensor against one memcpy of 256 MiB
//! and against rmp-serde with the bytes inline, and of batches of 1,000 small tensors.

use anyhow::{ensure, Result};
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tessera_framecodec::{decode, decode_contiguous, encode, DType, Encoder, Tensor, Value};

use crate::timing::{best_of, us};
use crate::Report;

const BIG: usize = 256 << 20;

/// The naive baseline: the tensor's bytes inline in one msgpack message.
#[derive(Serialize)]
struct InlineOut<'a> {
    dtype: &'a str,
    shape: &'a [u64],
    #[serde(with = "serde_bytes")]
    data: &'a [u8],
}

#[derive(Deserialize)]
struct InlineIn {
    #[allow(dead_code)]
    dtype: String,
    #[allow(dead_code)]
    shape: Vec<u64>,
    data: serde_bytes::ByteBuf,
}

fn batch(n: usize, bytes_each: usize) -> Value {
    Value::List(
        (0..n)
            .map(|i| {
                let data = Bytes::from(vec![i as u8; bytes_each]);
                Tensor::new(DType::F32, &[(bytes_each / 4) as u64], data)
                    .expect("shape matches the data")
                    .into()
            })
            .collect(),
    )
}

fn round_trip(v: &Value) -> Value {
    let f = encode(v).expect("encodes");
    decode(&f.meta, &f.payloads).expect("decodes")
}

/// Fills `report` with this suite's metrics.
pub fn run(report: &mut Report) -> Result<()> {
    // One 256 MiB tensor.
    let src = vec![1u8; BIG];
    let mut dst = vec![0u8; BIG];
    let memcpy = best_of(5, || (), |_| dst.copy_from_slice(&src));
    std::hint::black_box(&dst);
    drop(dst);
    let data = Bytes::from(src);
    let tensor = Tensor::new(DType::F32, &[(BIG / 4) as u64], data.clone())?;
    let value = Value::Tensor(tensor);
    let back = round_trip(&value);
    ensure!(
        back.as_tensor().map(|t| t.data().as_ptr()) == Some(data.as_ptr()),
        "the decoded tensor is not the encoded memory"
    );
    let codec = best_of(50, || (), |_| round_trip(&value));
    let encoded = encode(&value)?;
    let layout = encoded.layout(64)?;
    let buf = data.slice(..layout.size as usize);
    let contiguous = best_of(
        50,
        || (),
        |_| decode_contiguous(&encoded.meta, &buf, 64).expect("decodes"),
    );
    let rmp = best_of(
        3,
        || (),
        |_| {
            let out = InlineOut {
                dtype: "float32",
                shape: &[(BIG / 4) as u64],
                data: &data,
            };
            let bytes = rmp_serde::to_vec_named(&out).expect("serializes");
            let back: InlineIn = rmp_serde::from_slice(&bytes).expect("deserializes");
            back.data.len()
        },
    );
    report.put(
        "codec_256m_us",
        us(codec),
        "encode + decode (frame list) of one 256 MiB f32 tensor, best of 50",
    );
    report.put(
        "codec_256m_contiguous_decode_us",
        us(contiguous),
        "decode of the same from one laid-out buffer, best of 50",
    );
    report.put(
        "memcpy_256m_us",
        us(memcpy),
        "one 256 MiB copy_from_slice, best of 5",
    );
    report.put(
        "rmp_inline_256m_us",
        us(rmp),
        "rmp-serde with the bytes inline: serialize + deserialize to owned, best of 3",
    );
    report.put(
        "codec_256m_pct_of_memcpy",
        100.0 * codec.as_secs_f64() / memcpy.as_secs_f64(),
        "codec_256m_us / memcpy_256m_us, percent (goal <= 1)",
    );
    report.put(
        "rmp_inline_256m_over_codec",
        rmp.as_secs_f64() / codec.as_secs_f64(),
        "rmp_inline_256m_us / codec_256m_us",
    );
    drop((value, back, encoded, buf, data));

    // 1,000 tensors of 4 KiB: each its own frame (at the 4 KiB threshold).
    let v = batch(1000, 4096);
    let f = encode(&v)?;
    ensure!(
        f.frame_count() == 1001,
        "1000 x 4 KiB: {} frames",
        f.frame_count()
    );
    let both = best_of(200, || (), |_| round_trip(&v));
    let enc = best_of(200, || (), |_| encode(&v).expect("encodes"));
    let dec = best_of(
        200,
        || (),
        |_| decode(&f.meta, &f.payloads).expect("decodes"),
    );
    report.put(
        "codec_1000x4k_us",
        us(both),
        "encode + decode of 1,000 f32 tensors of 4 KiB (1,001 frames), best of 200 (goal <= 200)",
    );
    report.put(
        "codec_1000x4k_encode_us",
        us(enc),
        "encode only, best of 200",
    );
    report.put(
        "codec_1000x4k_decode_us",
        us(dec),
        "decode only, best of 200",
    );
    // The receiver's case: the frames landed in one buffer at the layout's offsets.
    let layout = f.layout(64)?;
    let mut laid = vec![0u8; layout.size as usize];
    for (i, p) in f.payloads.iter().enumerate() {
        laid[layout.range(i)].copy_from_slice(p);
    }
    let laid = Bytes::from(laid);
    let dec_laid = best_of(
        200,
        || (),
        |_| decode_contiguous(&f.meta, &laid, 64).expect("decodes"),
    );
    report.put(
        "codec_1000x4k_decode_contiguous_us",
        us(dec_laid),
        "decode only, from one buffer holding the frames at the layout's offsets (what a \
         storage unit and a GET's client do), best of 200",
    );
    report.put(
        "codec_1000x4k_meta_bytes",
        f.meta.len() as f64,
        "meta frame size (the list of same-shaped tensors is a run: FLAG_RUNS)",
    );
    // The same batch written out, one table entry and one node per tensor: what a decoder
    // that predates runs reads, and what every batch cost before them.
    let plain = Encoder::new().runs(false);
    let pf = plain.encode(&v)?;
    let plain_both = best_of(
        200,
        || (),
        |_| {
            let f = plain.encode(&v).expect("encodes");
            decode(&f.meta, &f.payloads).expect("decodes")
        },
    );
    report.put(
        "codec_1000x4k_plain_us",
        us(plain_both),
        "codec_1000x4k_us with Encoder::runs(false), best of 200",
    );
    report.put(
        "codec_1000x4k_plain_meta_bytes",
        pf.meta.len() as f64,
        "meta frame size with Encoder::runs(false)",
    );

    // 1,000 tensors of 16 bytes: packed into one shared frame.
    let v = batch(1000, 16);
    let f = encode(&v)?;
    ensure!(
        f.frame_count() == 2,
        "1000 x 16 B: {} frames",
        f.frame_count()
    );
    let both = best_of(200, || (), |_| round_trip(&v));
    report.put(
        "codec_1000x16b_us",
        us(both),
        "encode + decode of 1,000 f32 tensors of 16 B (packed: 2 frames), best of 200",
    );
    report.put(
        "codec_1000x16b_frames",
        f.frame_count() as f64,
        "frames on the wire, meta included",
    );
    report.put(
        "codec_1000x16b_meta_bytes",
        f.meta.len() as f64,
        "meta frame size",
    );
    Ok(())
}
