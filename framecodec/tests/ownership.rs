//! Decoded payloads keep the receive buffer's owner alive, and only as long as one is held.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use tessera_framecodec::{encode, DType, Decoder, Tensor, Value};

/// Stands for a pool lease: returns its block (sets the flag) when dropped.
struct Lease {
    block: Vec<u8>,
    returned: Arc<AtomicBool>,
}

impl AsRef<[u8]> for Lease {
    fn as_ref(&self) -> &[u8] {
        &self.block
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.returned.store(true, Ordering::SeqCst);
    }
}

/// A PUT of `{field: batch[B, ...]}` stored per sample, as a storage service would.
#[test]
fn a_stored_sample_pins_its_buffer_until_dropped() {
    let rows = 8u64;
    let data: Vec<i32> = (0..rows as i32 * 1024).collect();
    let batch = Tensor::from_slice(&[rows, 1024], &data).unwrap();
    let put = Value::map([
        ("input_ids", Value::Tensor(batch)),
        (
            "reward",
            Tensor::from_slice(&[rows], &[1.0f32; 8]).unwrap().into(),
        ),
    ]);
    let frames = encode(&put).unwrap();

    // The receiver sizes a block from the meta frame, the sender writes into it.
    let decoder = Decoder::new();
    let table = decoder.frame_table(&frames.meta).unwrap();
    let layout = table.layout(64).unwrap();
    let mut block = vec![0u8; layout.size as usize];
    for (i, f) in frames.payloads.iter().enumerate() {
        block[layout.range(i)].copy_from_slice(f);
    }
    let returned = Arc::new(AtomicBool::new(false));
    let buf = Bytes::from_owner(Lease {
        block,
        returned: returned.clone(),
    });

    let value = decoder.decode_contiguous(&frames.meta, &buf, 64).unwrap();
    let ids = value.get("input_ids").and_then(Value::as_tensor).unwrap();
    let per_sample = ids.unbind().unwrap();
    let sample3 = per_sample[3].clone();
    drop((value, per_sample, buf));
    assert!(
        !returned.load(Ordering::SeqCst),
        "a live sample must pin the block"
    );
    assert_eq!(sample3.dtype(), DType::I32);
    assert_eq!(sample3.as_slice::<i32>().unwrap()[0], 3 * 1024);
    drop(sample3);
    assert!(
        returned.load(Ordering::SeqCst),
        "the block returns with the last view"
    );
}

/// Rows sent as a list travel as their own frames, so a receiver that lands each frame in its
/// own lease lets every sample pin only its own block.
#[test]
fn rows_sent_as_a_list_pin_only_their_own_frame() {
    let data: Vec<u8> = (0..4 * 8192).map(|i| (i % 256) as u8).collect();
    let batch = Tensor::new(DType::U8, &[4, 8192], Bytes::from(data)).unwrap();
    let rows: Vec<Value> = batch
        .unbind()
        .unwrap()
        .into_iter()
        .map(Value::Tensor)
        .collect();
    let frames = encode(&Value::List(rows)).unwrap();
    assert_eq!(frames.payloads.len(), 4);
    // Each payload frame is a slice of the batch: no copy on the sender.
    for (i, f) in frames.payloads.iter().enumerate() {
        assert_eq!(
            f.as_ptr() as usize,
            batch.data().as_ptr() as usize + i * 8192
        );
    }
    let flags: Vec<Arc<AtomicBool>> = (0..4).map(|_| Arc::new(AtomicBool::new(false))).collect();
    let leased: Vec<Bytes> = frames
        .payloads
        .iter()
        .zip(&flags)
        .map(|(f, flag)| {
            Bytes::from_owner(Lease {
                block: f.to_vec(),
                returned: flag.clone(),
            })
        })
        .collect();
    let value = Decoder::new().decode(&frames.meta, &leased).unwrap();
    drop(leased);
    let keep = value.index(2).cloned().unwrap();
    drop(value);
    let returned: Vec<bool> = flags.iter().map(|f| f.load(Ordering::SeqCst)).collect();
    assert_eq!(returned, [true, true, false, true]);
    drop(keep);
    assert!(flags[2].load(Ordering::SeqCst));
}
