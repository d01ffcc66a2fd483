//! Quoting for the few strings rsb must hand to a shell it does not control: the login shell
//! sshd runs for rsb's own deploy snippets, and tmux before 3.0, which runs a job's command
//! line through `sh -c`. Everything else travels as argv or protocol data.

/// One POSIX shell word: single-quoted, with each `'` written as `'\''`. Works on bytes because
/// job arguments need not be UTF-8.
pub fn quote(s: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(s.len() + 2);
    out.push(b'\'');
    for &b in s {
        if b == b'\'' {
            out.extend_from_slice(b"'\\''");
        } else {
            out.push(b);
        }
    }
    out.push(b'\'');
    out
}

/// [`quote`] for text.
pub fn quote_str(s: &str) -> String {
    // Quoting only inserts ASCII around and inside valid UTF-8, so the result is UTF-8.
    String::from_utf8(quote(s.as_bytes())).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_input_becomes_one_inert_word() {
        assert_eq!(quote_str("a b"), "'a b'");
        assert_eq!(quote_str("it's"), "'it'\\''s'");
        assert_eq!(quote_str("$(x);`y`"), "'$(x);`y`'");
        assert_eq!(quote_str(""), "''");
        assert_eq!(quote(b"\xff\n"), b"'\xff\n'");
    }

    #[test]
    fn a_posix_shell_reads_the_word_back_unchanged() {
        let tricky = "a 'b' \"c\" $HOME `id` ; \\ \n*";
        let out = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!("printf '%s' {}", quote_str(tricky)))
            .output();
        match out {
            Ok(o) => assert_eq!(String::from_utf8_lossy(&o.stdout), tricky),
            Err(e) => eprintln!("skipping the shell round trip: cannot run sh: {e}"),
        }
    }
}
