//! The types of a sandbox entry's fields: each checks its own value and says what it must be
//! in words of its own ([`Want`]), never quoting the value (it may be a secret), and the
//! messages for a deserialization error that name the place and never the value.

use std::fmt;
use std::time::Duration;

use serde::{
    Deserialize, Deserializer,
    de::{self, DeserializeOwned},
};

use super::HostKeyPolicy;

/// What a field's value must be: the whole of a type error's text, so no character of the
/// value can reach a message.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Want {
    Text,
    Port,
    Policy,
    Flag,
    Seconds,
}

impl Want {
    const ALL: [Want; 5] = [
        Want::Text,
        Want::Port,
        Want::Policy,
        Want::Flag,
        Want::Seconds,
    ];

    fn what(self) -> &'static str {
        match self {
            Want::Text => "a string",
            Want::Port => "an integer between 1 and 65535",
            Want::Policy => "one of accept-new, strict, off",
            Want::Flag => "true or false",
            Want::Seconds => "a positive number of seconds",
        }
    }

    pub(super) fn error<E: de::Error>(self) -> E {
        E::custom(self.what())
    }

    /// The `Want` whose [`Want::error`] produced `message`, if any.
    fn of(message: &str) -> Option<Want> {
        Want::ALL.into_iter().find(|w| w.what() == message)
    }
}

/// Any value, reduced to what the field types need, without keeping text for errors.
pub(super) enum Loose {
    Absent,
    Bool(bool),
    Int(i128),
    Float(f64),
    Str(String),
    Other,
}

impl<'de> Deserialize<'de> for Loose {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Loose, D::Error> {
        struct V;
        impl<'de> de::Visitor<'de> for V {
            type Value = Loose;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a value")
            }
            fn visit_bool<E>(self, v: bool) -> Result<Loose, E> {
                Ok(Loose::Bool(v))
            }
            fn visit_i64<E>(self, v: i64) -> Result<Loose, E> {
                Ok(Loose::Int(v.into()))
            }
            fn visit_u64<E>(self, v: u64) -> Result<Loose, E> {
                Ok(Loose::Int(v.into()))
            }
            fn visit_f64<E>(self, v: f64) -> Result<Loose, E> {
                Ok(Loose::Float(v))
            }
            fn visit_str<E>(self, v: &str) -> Result<Loose, E> {
                Ok(Loose::Str(v.to_string()))
            }
            fn visit_string<E>(self, v: String) -> Result<Loose, E> {
                Ok(Loose::Str(v))
            }
            fn visit_bytes<E>(self, _: &[u8]) -> Result<Loose, E> {
                Ok(Loose::Other)
            }
            fn visit_none<E>(self) -> Result<Loose, E> {
                Ok(Loose::Absent)
            }
            fn visit_unit<E>(self) -> Result<Loose, E> {
                Ok(Loose::Absent)
            }
            fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Loose, D::Error> {
                Loose::deserialize(d)
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, mut a: A) -> Result<Loose, A::Error> {
                while a.next_element::<de::IgnoredAny>()?.is_some() {}
                Ok(Loose::Other)
            }
            fn visit_map<A: de::MapAccess<'de>>(self, mut a: A) -> Result<Loose, A::Error> {
                while a.next_entry::<de::IgnoredAny, de::IgnoredAny>()?.is_some() {}
                Ok(Loose::Other)
            }
        }
        d.deserialize_any(V)
    }
}

/// A string, trimmed; absent, null and blank are `None`.
#[derive(Default)]
pub(super) struct Text(pub(super) Option<String>);

impl<'de> Deserialize<'de> for Text {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Text, D::Error> {
        match Loose::deserialize(d)? {
            Loose::Absent => Ok(Text(None)),
            Loose::Str(s) => Ok(Text(Some(s.trim().to_string()).filter(|s| !s.is_empty()))),
            _ => Err(Want::Text.error()),
        }
    }
}

/// A port: an integer, an integral float or a numeric string; blank is `None`.
#[derive(Default)]
pub(super) struct Port(pub(super) Option<u16>);

impl<'de> Deserialize<'de> for Port {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Port, D::Error> {
        let port = match Loose::deserialize(d)? {
            Loose::Absent => return Ok(Port(None)),
            Loose::Str(s) if s.trim().is_empty() => return Ok(Port(None)),
            Loose::Str(s) => parse_port(&s),
            Loose::Int(n) => u16::try_from(n).ok(),
            Loose::Float(f) if f.fract() == 0.0 && (0.0..=65535.0).contains(&f) => Some(f as u16),
            _ => None,
        };
        match port.filter(|p| *p != 0) {
            Some(p) => Ok(Port(Some(p))),
            None => Err(Want::Port.error()),
        }
    }
}

/// `2222`, ` +2222 `; not 0.
pub(super) fn parse_port(s: &str) -> Option<u16> {
    let s = s.trim();
    s.strip_prefix('+')
        .unwrap_or(s)
        .parse()
        .ok()
        .filter(|p| *p != 0)
}

#[derive(Default)]
pub(super) struct Policy(pub(super) Option<HostKeyPolicy>);

impl<'de> Deserialize<'de> for Policy {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Policy, D::Error> {
        match Loose::deserialize(d)? {
            Loose::Absent => Ok(Policy(None)),
            Loose::Str(s) if s.trim().is_empty() => Ok(Policy(None)),
            Loose::Str(s) => HostKeyPolicy::parse(&s)
                .map(|p| Policy(Some(p)))
                .ok_or_else(|| Want::Policy.error()),
            _ => Err(Want::Policy.error()),
        }
    }
}

#[derive(Default)]
pub(super) struct Flag(pub(super) bool);

impl<'de> Deserialize<'de> for Flag {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Flag, D::Error> {
        match Loose::deserialize(d)? {
            Loose::Absent => Ok(Flag(false)),
            Loose::Bool(b) => Ok(Flag(b)),
            _ => Err(Want::Flag.error()),
        }
    }
}

/// Seconds, integral or not, in (0, 1 day].
#[derive(Default)]
pub(super) struct Seconds(pub(super) Option<Duration>);

impl<'de> Deserialize<'de> for Seconds {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Seconds, D::Error> {
        let secs = match Loose::deserialize(d)? {
            Loose::Absent => return Ok(Seconds(None)),
            Loose::Int(n) => n as f64,
            Loose::Float(f) => f,
            _ => f64::NAN,
        };
        if secs.is_finite() && secs > 0.0 && secs <= 86_400.0 {
            Ok(Seconds(Some(Duration::from_secs_f64(secs))))
        } else {
            Err(Want::Seconds.error())
        }
    }
}

/// The field names serde derived for `T`, read by asking `T` to deserialize itself from a
/// deserializer that only records them: the struct stays the one list of valid keys.
pub(super) fn field_names<T: DeserializeOwned>() -> &'static [&'static str] {
    struct Names<'a>(&'a mut &'static [&'static str]);
    impl<'de> Deserializer<'de> for Names<'_> {
        type Error = de::value::Error;
        fn deserialize_any<V: de::Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
            Err(de::Error::custom("not a struct"))
        }
        fn deserialize_struct<V: de::Visitor<'de>>(
            self,
            _: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, Self::Error> {
            *self.0 = fields;
            Err(de::Error::custom("field names recorded"))
        }
        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes
            byte_buf option unit unit_struct newtype_struct seq tuple tuple_struct map enum
            identifier ignored_any
        }
    }
    let mut fields: &'static [&'static str] = &[];
    let _ = T::deserialize(Names(&mut fields));
    fields
}

/// Where a deserialization failed (`sandbox[0]` and the field) and why, in words that never
/// include a value: the field's [`Want`], an unknown key (named only when it looks like a
/// name), or only the place. Returns the message and its hint; `keys_hint` lists valid keys.
pub(super) fn describe_de_error(
    path: &serde_path_to_error::Path,
    message: &str,
    keys_hint: &str,
) -> (String, String) {
    use serde_path_to_error::Segment;
    let segments: Vec<&Segment> = path.iter().collect();
    let (field, parents) = match segments.split_last() {
        Some((Segment::Map { key }, parents)) => (Some(key.as_str()), parents),
        _ => (None, &segments[..]),
    };
    let mut place = String::new();
    for seg in parents {
        match seg {
            Segment::Seq { index } => place.push_str(&format!("[{index}]")),
            Segment::Map { key } => {
                if !place.is_empty() {
                    place.push('.');
                }
                place.push_str(key);
            }
            _ => {}
        }
    }
    let at = |what: String| {
        if place.is_empty() {
            what
        } else {
            format!("{place} {what}")
        }
    };
    let not_shown = "The value is not shown, to keep secrets out of logs.".to_string();
    if let Some(key) = message
        .strip_prefix("unknown field `")
        .and_then(|rest| rest.split('`').next())
    {
        let what = format!("unknown key {}", key_name(key));
        // The path ends at the unknown key itself, or at the table holding it.
        let msg = match field {
            Some(f) if f != key => at(format!("field '{f}' has {what}")),
            _ if place.is_empty() => what,
            _ => format!("{place} has {what}"),
        };
        return (msg, keys_hint.to_string());
    }
    let msg = match (field, Want::of(message)) {
        (Some(f), Some(want)) => at(format!("field '{f}' must be {}", want.what())),
        (Some(f), None) => at(format!("field '{f}' has a value of the wrong type")),
        (None, _) => at("must be a table".to_string()),
    };
    (msg, not_shown)
}

/// An unknown key, quoted, when it looks like a field name; otherwise not shown (a stray key could
/// be a mangled secret).
pub(super) fn key_name(k: &str) -> String {
    let plain = !k.is_empty()
        && k.len() <= 40
        && k.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if plain {
        format!("'{k}'")
    } else {
        "(name not shown: not a plain identifier)".to_string()
    }
}
