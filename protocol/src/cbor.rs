//! A structural pre-check of untrusted CBOR, run before serde sees the bytes.
//!
//! serde preallocates a `Vec` from a sequence's declared length (capped, but still up to about
//! a mebibyte per sequence); a ten-byte message declaring a billion-element array must not cost
//! that. This walk checks, without allocating per item, that every declared length fits in the
//! bytes that remain (each element takes at least one byte), that nesting is shallow, that
//! there is exactly one item and nothing after it, and that nothing is of indefinite length or
//! tagged (our encoder never writes either). After it, decoding allocates at most a small
//! multiple of the input's size.

/// Deepest nesting any of our messages uses is 5; leave room, refuse anything silly.
pub const MAX_DEPTH: usize = 16;

/// Why the pre-check refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PrecheckError {
    Truncated,
    TrailingBytes,
    TooDeep,
    LengthExceedsInput,
    Indefinite,
    Reserved,
    Tagged,
}

impl std::fmt::Display for PrecheckError {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        let s = match self {
            PrecheckError::Truncated => "truncated",
            PrecheckError::TrailingBytes => "trailing bytes after the item",
            PrecheckError::TooDeep => "nested too deep",
            PrecheckError::LengthExceedsInput => "declared length exceeds the input",
            PrecheckError::Indefinite => "indefinite-length item",
            PrecheckError::Reserved => "reserved additional-information value",
            PrecheckError::Tagged => "tagged item",
        };
        f.write_str(s)
    }
}

/// Check that `b` is exactly one well-formed CBOR item within our subset.
pub fn precheck(b: &[u8]) -> Result<(), PrecheckError> {
    // Each stack entry: items still to read in an open array or map.
    let mut stack: Vec<u64> = Vec::with_capacity(MAX_DEPTH);
    let mut pos = 0usize;
    let mut top_items = 1u64;
    loop {
        // Close every container that is finished.
        while let Some(&0) = stack.last() {
            stack.pop();
        }
        match stack.last_mut() {
            Some(n) => *n -= 1,
            None => {
                if top_items == 0 {
                    return if pos == b.len() {
                        Ok(())
                    } else {
                        Err(PrecheckError::TrailingBytes)
                    };
                }
                top_items -= 1;
            }
        }
        let ib = *b.get(pos).ok_or(PrecheckError::Truncated)?;
        pos += 1;
        let major = ib >> 5;
        let ai = ib & 0x1f;
        let arg: u64 = match ai {
            0..=23 => ai as u64,
            24..=27 => {
                let n = 1usize << (ai - 24);
                let bytes = b.get(pos..pos + n).ok_or(PrecheckError::Truncated)?;
                pos += n;
                bytes.iter().fold(0u64, |acc, &x| acc << 8 | x as u64)
            }
            28..=30 => return Err(PrecheckError::Reserved),
            _ => return Err(PrecheckError::Indefinite),
        };
        let remaining = (b.len() - pos) as u64;
        match major {
            0 | 1 => {}
            2 | 3 => {
                if arg > remaining {
                    return Err(PrecheckError::LengthExceedsInput);
                }
                pos += arg as usize;
            }
            4 | 5 => {
                let items = if major == 5 {
                    arg.checked_mul(2)
                        .ok_or(PrecheckError::LengthExceedsInput)?
                } else {
                    arg
                };
                if items > remaining {
                    return Err(PrecheckError::LengthExceedsInput);
                }
                if items > 0 {
                    if stack.len() >= MAX_DEPTH {
                        return Err(PrecheckError::TooDeep);
                    }
                    stack.push(items);
                }
            }
            6 => return Err(PrecheckError::Tagged),
            // Simple values and floats: the argument bytes were already consumed.
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_what_serde_cbor_writes() {
        let v: Vec<(String, Vec<u8>, Option<f64>)> = vec![
            ("a".into(), vec![1, 2, 3], Some(1.5)),
            ("b".into(), vec![], None),
        ];
        let enc = serde_cbor::to_vec(&v).unwrap();
        precheck(&enc).unwrap();
        let mut trailing = enc.clone();
        trailing.push(0);
        assert_eq!(precheck(&trailing), Err(PrecheckError::TrailingBytes));
        assert_eq!(
            precheck(&enc[..enc.len() - 1]),
            Err(PrecheckError::Truncated)
        );
    }

    #[test]
    fn refuses_huge_declared_lengths_and_depth() {
        // array of 2^32 items in 5 bytes
        assert_eq!(
            precheck(&[0x9a, 0xff, 0xff, 0xff, 0xff]),
            Err(PrecheckError::LengthExceedsInput)
        );
        // map of 2^63 pairs
        assert_eq!(
            precheck(&[0xbb, 0x80, 0, 0, 0, 0, 0, 0, 0]),
            Err(PrecheckError::LengthExceedsInput)
        );
        assert_eq!(
            precheck(&[0x5b, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]),
            Err(PrecheckError::LengthExceedsInput)
        );
        let deep = vec![0x81u8; 100];
        assert_eq!(precheck(&deep), Err(PrecheckError::TooDeep));
        assert_eq!(precheck(&[0x9f, 0xff]), Err(PrecheckError::Indefinite));
        assert_eq!(precheck(&[0xc1, 0x00]), Err(PrecheckError::Tagged));
        assert_eq!(precheck(&[]), Err(PrecheckError::Truncated));
    }
}
