//! Turning captured bytes into text a model can read, without hiding what was lost.

use rsb_protocol::Captured;

/// Rendered output: text, whether bytes were dropped, whether invalid UTF-8 was replaced.
#[derive(Debug, Clone, PartialEq)]
pub struct Rendered {
    pub text: String,
    pub truncated: bool,
    pub lossy: bool,
}

/// Decode `c` lossily. When truncated, the head and tail are joined by a marker that says how
/// many bytes were dropped; UTF-8 sequences cut by the cap are trimmed rather than reported
/// as invalid output.
pub fn render(c: &Captured) -> Rendered {
    if !c.truncated() {
        let mut bytes = c.head.clone();
        bytes.extend_from_slice(&c.tail);
        let lossy = std::str::from_utf8(&bytes).is_err();
        return Rendered {
            text: String::from_utf8_lossy(&bytes).into_owned(),
            truncated: false,
            lossy,
        };
    }
    let head = trim_incomplete_end(&c.head);
    let tail = trim_partial_start(&c.tail);
    let lossy = std::str::from_utf8(head).is_err() || std::str::from_utf8(tail).is_err();
    let mut text = String::from_utf8_lossy(head).into_owned();
    text.push_str(&marker(c));
    text.push_str(&String::from_utf8_lossy(tail));
    Rendered {
        text,
        truncated: true,
        lossy,
    }
}

/// The bytes of `c` as they were (for a terminal or a pipe, not a model), with
/// [`render`]'s marker where the middle was dropped.
pub fn raw(c: &Captured) -> Vec<u8> {
    let mut out = c.head.clone();
    if c.truncated() {
        out.extend_from_slice(marker(c).as_bytes());
    }
    out.extend_from_slice(&c.tail);
    out
}

/// Where the middle of a truncated capture was, and how much of it there was.
fn marker(c: &Captured) -> String {
    format!("\n...<truncated {} bytes>...\n", c.omitted())
}

fn trim_incomplete_end(b: &[u8]) -> &[u8] {
    match std::str::from_utf8(b) {
        Err(e) if e.error_len().is_none() => &b[..e.valid_up_to()],
        _ => b,
    }
}

fn trim_partial_start(b: &[u8]) -> &[u8] {
    let skip = b.iter().take(3).take_while(|&&x| x & 0xC0 == 0x80).count();
    &b[skip..]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_output_is_kept() {
        let r = render(&Captured {
            head: b"hi\n".to_vec(),
            tail: vec![],
            total: 3,
        });
        assert_eq!(
            r,
            Rendered {
                text: "hi\n".into(),
                truncated: false,
                lossy: false
            }
        );
    }

    #[test]
    fn invalid_utf8_is_flagged() {
        let r = render(&Captured {
            head: vec![b'a', 0xff, b'b'],
            tail: vec![],
            total: 3,
        });
        assert!(r.lossy);
        assert_eq!(r.text, "a\u{fffd}b");
    }

    #[test]
    fn cut_multibyte_chars_are_trimmed_not_flagged() {
        let s = "ééé".as_bytes();
        let r = render(&Captured {
            head: s[..3].to_vec(),
            tail: s[3..].to_vec(),
            total: 100,
        });
        assert!(r.truncated);
        assert!(!r.lossy, "{r:?}");
        assert!(r.text.starts_with('é'));
        assert!(r.text.contains("<truncated 94 bytes>"));
    }
}

pub use crate::term::human_bytes;

#[cfg(test)]
mod human_tests {
    #[test]
    fn byte_counts_read_like_a_human_wrote_them() {
        assert_eq!(super::human_bytes(0), "0 B");
        assert_eq!(super::human_bytes(1023), "1023 B");
        assert_eq!(super::human_bytes(1536), "1.5 KiB");
        assert_eq!(super::human_bytes(100 << 20), "100.0 MiB");
    }
}
