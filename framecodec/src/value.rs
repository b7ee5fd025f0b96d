//! The value model: scalars, lists, ordered string-keyed maps and tensors.

use bytes::Bytes;

use crate::Tensor;

/// A nested value, as sent between processes.
///
/// Byte strings and tensors hold `Bytes`: encoding sends them as they are and decoding returns
/// slices of the received buffer, so neither copies payloads.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// Nothing.
    Null,
    /// A boolean.
    Bool(bool),
    /// A signed 64-bit integer.
    I64(i64),
    /// An unsigned 64-bit integer (kept apart from `I64` on the wire).
    U64(u64),
    /// A 64-bit float.
    F64(f64),
    /// A UTF-8 string (travels inside the meta frame).
    Str(String),
    /// A byte string (travels as a payload, like a tensor of `u8`).
    Bytes(Bytes),
    /// A list.
    List(Vec<Value>),
    /// A map with string keys, in insertion order. Keys are not required to be unique; lookups
    /// return the first match.
    Map(Vec<(String, Value)>),
    /// A tensor.
    Tensor(Tensor),
}

/// One step of a path into a value, for [`Value::pointer`] and partial decoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathSeg<'a> {
    /// The entry of a map with this key (the first one).
    Key(&'a str),
    /// The item of a list at this index, or the row of a tensor's leading dimension.
    Index(u64),
}

impl<'a> From<&'a str> for PathSeg<'a> {
    fn from(key: &'a str) -> Self {
        PathSeg::Key(key)
    }
}

impl From<u64> for PathSeg<'_> {
    fn from(index: u64) -> Self {
        PathSeg::Index(index)
    }
}

impl From<usize> for PathSeg<'_> {
    fn from(index: usize) -> Self {
        PathSeg::Index(index as u64)
    }
}

impl Value {
    /// A map from `(key, value)` pairs, keeping their order.
    pub fn map<K: Into<String>>(entries: impl IntoIterator<Item = (K, Value)>) -> Value {
        Value::Map(entries.into_iter().map(|(k, v)| (k.into(), v)).collect())
    }

    /// The first entry with `key`, when this is a map.
    pub fn get(&self, key: &str) -> Option<&Value> {
        match self {
            Value::Map(entries) => entries.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    /// The item at `index`, when this is a list.
    pub fn index(&self, index: usize) -> Option<&Value> {
        match self {
            Value::List(items) => items.get(index),
            _ => None,
        }
    }

    /// The items, when this is a list; an empty list otherwise.
    pub fn into_list(self) -> Vec<Value> {
        match self {
            Value::List(items) => items,
            _ => Vec::new(),
        }
    }

    /// The tensor, when this is one.
    pub fn as_tensor(&self) -> Option<&Tensor> {
        match self {
            Value::Tensor(t) => Some(t),
            _ => None,
        }
    }

    /// The value at `path`: map keys, list indexes, and tensor rows (a row is a slice of the
    /// tensor's payload, no copy). `None` when a step does not apply.
    pub fn pointer(&self, path: &[PathSeg<'_>]) -> Option<Value> {
        let Some((first, rest)) = path.split_first() else {
            return Some(self.clone());
        };
        match (self, first) {
            (Value::Map(_), PathSeg::Key(k)) => self.get(k)?.pointer(rest),
            (Value::List(items), PathSeg::Index(i)) => {
                items.get(usize::try_from(*i).ok()?)?.pointer(rest)
            }
            (Value::Tensor(t), PathSeg::Index(_)) => tensor_pointer(t, path),
            _ => None,
        }
    }

    /// Replaces every tensor or byte string shorter than `max_len` bytes by a copy of its own,
    /// so that small values kept for long stop pinning a shared receive buffer. Copies those
    /// bytes only; larger payloads stay views.
    pub fn detach_small(&mut self, max_len: usize) {
        match self {
            Value::Bytes(b) if b.len() < max_len => *b = Bytes::copy_from_slice(b),
            Value::Tensor(t) if t.data().len() < max_len => *t = t.detached(),
            Value::List(items) => items.iter_mut().for_each(|v| v.detach_small(max_len)),
            Value::Map(entries) => entries
                .iter_mut()
                .for_each(|(_, v)| v.detach_small(max_len)),
            _ => {}
        }
    }
}

/// Follows tensor rows for every remaining index step.
pub(crate) fn tensor_pointer(t: &Tensor, path: &[PathSeg<'_>]) -> Option<Value> {
    let mut t = t.clone();
    for seg in path {
        match seg {
            PathSeg::Index(i) => t = t.row(*i).ok()?,
            PathSeg::Key(_) => return None,
        }
    }
    Some(Value::Tensor(t))
}

impl From<Tensor> for Value {
    fn from(t: Tensor) -> Self {
        Value::Tensor(t)
    }
}

impl From<bool> for Value {
    fn from(v: bool) -> Self {
        Value::Bool(v)
    }
}

impl From<i64> for Value {
    fn from(v: i64) -> Self {
        Value::I64(v)
    }
}

impl From<u64> for Value {
    fn from(v: u64) -> Self {
        Value::U64(v)
    }
}

impl From<f64> for Value {
    fn from(v: f64) -> Self {
        Value::F64(v)
    }
}

impl From<&str> for Value {
    fn from(v: &str) -> Self {
        Value::Str(v.to_owned())
    }
}

impl From<String> for Value {
    fn from(v: String) -> Self {
        Value::Str(v)
    }
}

impl From<Bytes> for Value {
    fn from(v: Bytes) -> Self {
        Value::Bytes(v)
    }
}

impl From<Vec<Value>> for Value {
    fn from(v: Vec<Value>) -> Self {
        Value::List(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;

    #[test]
    fn pointer_walks_maps_lists_and_rows() {
        let t = Tensor::from_slice(&[3, 2], &[0u16, 1, 2, 3, 4, 5]).unwrap();
        let v = Value::map([
            ("ids", Value::Tensor(t.clone())),
            ("tags", Value::List(vec!["a".into(), "b".into()])),
        ]);
        assert_eq!(
            v.pointer(&["tags".into(), 1u64.into()]),
            Some(Value::from("b"))
        );
        let row = v.pointer(&["ids".into(), 2u64.into()]).unwrap();
        let row = row.as_tensor().unwrap();
        assert_eq!(row.as_slice::<u16>().unwrap(), &[4, 5]);
        assert_eq!(row.dtype(), DType::U16);
        assert_eq!(v.pointer(&["ids".into(), 3u64.into()]), None);
        assert_eq!(v.pointer(&["nope".into()]), None);
        assert_eq!(v.pointer(&[0u64.into()]), None);
    }

    #[test]
    fn detach_small_copies_only_small_payloads() {
        let big = Bytes::from(vec![1u8; 100]);
        let small = Bytes::from(vec![2u8; 10]);
        let mut v = Value::List(vec![Value::Bytes(big.clone()), Value::Bytes(small.clone())]);
        v.detach_small(50);
        let Value::List(items) = &v else { panic!() };
        let Value::Bytes(b0) = &items[0] else {
            panic!()
        };
        let Value::Bytes(b1) = &items[1] else {
            panic!()
        };
        assert_eq!(b0.as_ptr(), big.as_ptr());
        assert_ne!(b1.as_ptr(), small.as_ptr());
        assert_eq!(b1, &small);
    }
}
