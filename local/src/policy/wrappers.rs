//! Programs that run their arguments as a command (`env`, `sudo`, `xargs`, `timeout`, …) or
//! as shell code (`bash -c`, `eval`, `trap`, `ssh host CMD`, `watch`, `su -c`): what they run.
//!
//! Each wrapper's options are spelled out, with the ones that take an argument, because an
//! option whose argument is mistaken for the command hides the real command. An option a
//! table does not know, or a word only known at run time where an option could be, makes
//! the rest unknown rather than guessed.

use super::words::{Arg, WordVal};

/// What a wrapper runs.
pub enum Inner {
    /// These words as a simple command.
    Command(Vec<WordVal>),
    /// This text as a bash script.
    Script(String),
    /// Its standard input as a script (a shell with no `-c` and no script file).
    Stdin,
    /// Something this cannot see: counts as any command.
    Unknown(&'static str),
}

/// A wrapper's options: short letters that take an argument (attached or the next word),
/// short flags, and long options that take one (`--opt=v` or `--opt v`) or none.
struct Opts {
    short_arg: &'static str,
    short_flag: &'static str,
    long_arg: &'static [&'static str],
    long_flag: &'static [&'static str],
}

/// Where the operands start, and the option letters and long options seen; `Err` when an
/// option is not in the table or a word where an option could be is not known.
struct Parsed {
    operands: usize,
    seen: String,
    long: Vec<String>,
    /// Arguments of options, by letter (`-c STR`).
    values: Vec<(char, Arg)>,
    /// Arguments of long options (`--split-string=STR`, `--replace=R`).
    long_values: Vec<(String, Arg)>,
}

impl Parsed {
    /// The argument of `-c` or `--long` (the last one given).
    fn value(&self, short: char, long: &str) -> Option<&Arg> {
        let s = self.values.iter().rev().find(|(c, _)| *c == short);
        s.map(|(_, v)| v).or(self.long_value(long))
    }

    fn long_value(&self, long: &str) -> Option<&Arg> {
        let l = self.long_values.iter().rev().find(|(n, _)| n == long);
        l.map(|(_, v)| v)
    }
}

fn parse(o: &Opts, args: &[WordVal]) -> Result<Parsed, &'static str> {
    let mut p = Parsed {
        operands: args.len(),
        seen: String::new(),
        long: Vec::new(),
        values: Vec::new(),
        long_values: Vec::new(),
    };
    let mut i = 0;
    while i < args.len() {
        let Some(a) = args[i].lit() else {
            // `sudo $OPTS rm`: an option or the command, no way to tell.
            return Err("a wrapper option not known before it runs");
        };
        if a == "--" {
            p.operands = i + 1;
            return Ok(p);
        }
        if let Some(long) = a.strip_prefix("--") {
            let name = long.split('=').next().unwrap_or(long);
            let full = format!("--{name}");
            if o.long_arg.contains(&full.as_str()) {
                let value = match long.split_once('=') {
                    Some((_, v)) => Arg::Lit(v.to_string()),
                    None => {
                        i += 1;
                        args.get(i)
                            .map(|w| w.arg.clone())
                            .unwrap_or(Arg::Unknown { many: false })
                    }
                };
                p.long_values.push((full.clone(), value));
            } else if o.long_flag.contains(&full.as_str()) {
                if let Some((_, v)) = long.split_once('=') {
                    // An optional argument (`--replace=R`).
                    p.long_values.push((full.clone(), Arg::Lit(v.to_string())));
                }
            } else {
                return Err("a wrapper option this guard does not know");
            }
            p.long.push(full);
            i += 1;
            continue;
        }
        if a.len() > 1 && a.starts_with('-') {
            let letters: Vec<char> = a[1..].chars().collect();
            let mut j = 0;
            while j < letters.len() {
                let c = letters[j];
                p.seen.push(c);
                if o.short_arg.contains(c) {
                    let rest: String = letters[j + 1..].iter().collect();
                    if rest.is_empty() {
                        i += 1;
                        p.values.push((
                            c,
                            args.get(i)
                                .map(|w| w.arg.clone())
                                .unwrap_or(Arg::Unknown { many: false }),
                        ));
                    } else {
                        p.values.push((c, Arg::Lit(rest)));
                    }
                    break;
                }
                if !o.short_flag.contains(c) {
                    return Err("a wrapper option this guard does not know");
                }
                j += 1;
            }
            i += 1;
            continue;
        }
        p.operands = i;
        return Ok(p);
    }
    Ok(p)
}

fn words(args: &[WordVal]) -> Vec<WordVal> {
    args.to_vec()
}

/// Leading `NAME=value` words (`env X=1 cmd`, `sudo X=1 cmd`) are not the command.
fn skip_assignments(args: &[WordVal]) -> &[WordVal] {
    let n = args
        .iter()
        .take_while(|w| {
            w.lit().is_some_and(|s| {
                s.split_once('=').is_some_and(|(k, _)| {
                    !k.is_empty()
                        && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                        && !k.starts_with(|c: char| c.is_ascii_digit())
                })
            })
        })
        .count();
    &args[n..]
}

/// Words joined as the shell code another program runs (`ssh host a b`, `watch a b`).
fn joined(args: &[WordVal]) -> Inner {
    let mut s = String::new();
    for w in args {
        match w.lit() {
            Some(l) => {
                if !s.is_empty() {
                    s.push(' ');
                }
                s.push_str(l);
            }
            None => return Inner::Unknown("shell code not known before it runs"),
        }
    }
    Inner::Script(s)
}

fn script_of(a: &Arg) -> Inner {
    match a {
        Arg::Lit(s) => Inner::Script(s.clone()),
        Arg::Unknown { .. } => Inner::Unknown("shell code not known before it runs"),
    }
}

/// The operands after `p`, as a command (none: nothing runs).
fn command_at(args: &[WordVal], at: usize) -> Vec<Inner> {
    let rest = &args[at.min(args.len())..];
    if rest.is_empty() {
        Vec::new()
    } else {
        vec![Inner::Command(words(rest))]
    }
}

fn with(o: &Opts, args: &[WordVal], f: impl FnOnce(Parsed) -> Vec<Inner>) -> Vec<Inner> {
    match parse(o, args) {
        Ok(p) => f(p),
        Err(why) => vec![Inner::Unknown(why)],
    }
}

const SHELLS: [&str; 11] = [
    "bash",
    "sh",
    "dash",
    "zsh",
    "ksh",
    "mksh",
    "ash",
    "yash",
    "posh",
    "fish",
    "busybox-sh",
];

/// A shell: its arguments become the positional parameters of what it runs.
pub fn is_shell(name: &str) -> bool {
    SHELLS.contains(&name) || name == "csh" || name == "tcsh"
}

/// What the command `name` (a basename) with `args` runs besides itself; `None` when it is
/// not a wrapper this table knows.
pub fn inner(name: &str, args: &[WordVal]) -> Option<Vec<Inner>> {
    Some(match name {
        n if is_shell(n) => shell(args),
        "eval" => vec![match joined(args) {
            Inner::Unknown(_) => Inner::Unknown("eval of a string not known before it runs"),
            known => known,
        }],
        "env" => env(args),
        "command" => with(
            &Opts {
                short_arg: "",
                short_flag: "pvV",
                long_arg: &[],
                long_flag: &[],
            },
            args,
            |p| {
                if p.seen.contains(['v', 'V']) {
                    Vec::new()
                } else {
                    command_at(args, p.operands)
                }
            },
        ),
        "builtin" | "nohup" | "unbuffer" => {
            let at = usize::from(args.first().and_then(WordVal::lit) == Some("--"));
            command_at(args, at)
        }
        "exec" => with(
            &Opts {
                short_arg: "a",
                short_flag: "cl",
                long_arg: &[],
                long_flag: &[],
            },
            args,
            |p| command_at(args, p.operands),
        ),
        "time" => with(
            &Opts {
                short_arg: "fo",
                short_flag: "pavq",
                long_arg: &["--format", "--output"],
                long_flag: &["--portability", "--append", "--verbose", "--quiet"],
            },
            args,
            |p| command_at(args, p.operands),
        ),
        "nice" => nice(args),
        "timeout" => with(
            &Opts {
                short_arg: "sk",
                short_flag: "fpv",
                long_arg: &["--signal", "--kill-after"],
                long_flag: &["--foreground", "--preserve-status", "--verbose"],
            },
            args,
            |p| command_at(args, p.operands + 1),
        ),
        "setsid" => with(
            &Opts {
                short_arg: "",
                short_flag: "cfw",
                long_arg: &[],
                long_flag: &["--ctty", "--fork", "--wait"],
            },
            args,
            |p| command_at(args, p.operands),
        ),
        "stdbuf" => with(
            &Opts {
                short_arg: "ioe",
                short_flag: "",
                long_arg: &["--input", "--output", "--error"],
                long_flag: &[],
            },
            args,
            |p| command_at(args, p.operands),
        ),
        "ionice" => with(
            &Opts {
                short_arg: "cnpPu",
                short_flag: "t",
                long_arg: &["--class", "--classdata", "--pid", "--pgid", "--uid"],
                long_flag: &["--ignore"],
            },
            args,
            |p| command_at(args, p.operands),
        ),
        "chrt" => with(
            &Opts {
                short_arg: "TPD",
                short_flag: "abdefiormRv",
                long_arg: &["--sched-runtime", "--sched-period", "--sched-deadline"],
                long_flag: &[
                    "--all-tasks",
                    "--batch",
                    "--deadline",
                    "--ext",
                    "--fifo",
                    "--idle",
                    "--other",
                    "--rr",
                    "--reset-on-fork",
                    "--verbose",
                ],
            },
            args,
            |p| command_at(args, p.operands + 1),
        ),
        "taskset" => with(
            &Opts {
                short_arg: "",
                short_flag: "acp",
                long_arg: &[],
                long_flag: &["--all-tasks", "--cpu-list", "--pid"],
            },
            args,
            |p| {
                if p.seen.contains('p') || p.long.iter().any(|l| l == "--pid") {
                    Vec::new()
                } else {
                    command_at(args, p.operands + 1)
                }
            },
        ),
        "sudo" => with(
            &Opts {
                short_arg: "CDghpRrTtUu",
                short_flag: "AbBEeHiKklnNPSsVv",
                long_arg: &[
                    "--close-from",
                    "--chdir",
                    "--group",
                    "--host",
                    "--prompt",
                    "--chroot",
                    "--role",
                    "--command-timeout",
                    "--type",
                    "--other-user",
                    "--user",
                ],
                long_flag: &[
                    "--askpass",
                    "--background",
                    "--bell",
                    "--preserve-env",
                    "--edit",
                    "--set-home",
                    "--login",
                    "--remove-timestamp",
                    "--reset-timestamp",
                    "--list",
                    "--non-interactive",
                    "--preserve-groups",
                    "--stdin",
                    "--shell",
                    "--version",
                    "--validate",
                    "--help",
                ],
            },
            args,
            |p| {
                let rest = skip_assignments(&args[p.operands.min(args.len())..]);
                let shell = p.seen.contains(['s', 'i'])
                    || p.long.iter().any(|l| l == "--shell" || l == "--login");
                if rest.is_empty() && shell {
                    // `sudo -s` / `sudo -i`: a root shell reading its script from stdin.
                    vec![Inner::Stdin]
                } else {
                    command_at(rest, 0)
                }
            },
        ),
        "doas" => with(
            &Opts {
                short_arg: "uC",
                short_flag: "Lns",
                long_arg: &[],
                long_flag: &[],
            },
            args,
            |p| command_at(args, p.operands),
        ),
        "pkexec" => with(
            &Opts {
                short_arg: "",
                short_flag: "",
                long_arg: &["--user"],
                long_flag: &["--disable-internal-agent", "--keep-cwd"],
            },
            args,
            |p| command_at(args, p.operands),
        ),
        "su" | "runuser" | "sg" | "script" => dash_c(name, args),
        "xargs" => xargs(args),
        "parallel" => {
            // GNU parallel has too many options to follow; only its plain form is known.
            match args.first().and_then(WordVal::lit) {
                // No command: it runs its input lines as commands.
                None if args.is_empty() => return Some(vec![Inner::Stdin]),
                Some(a) if !a.starts_with('-') => {}
                _ => return Some(vec![Inner::Unknown("parallel with options")]),
            }
            let end = args
                .iter()
                .position(|w| w.lit().is_some_and(|s| s.starts_with(":::")))
                .unwrap_or(args.len());
            // `{}`, `{.}`, `{1}`…: the input, pasted into the word (a script too).
            let mut ws = replaced(&args[..end], |s| s.contains('{') && s.contains('}'));
            ws.push(WordVal::unknown(true));
            vec![Inner::Command(ws)]
        }
        "find" => find(args),
        "watch" => with(
            &Opts {
                short_arg: "nq",
                short_flag: "bcdeghptwx",
                long_arg: &["--interval", "--equexit"],
                long_flag: &[
                    "--beep",
                    "--color",
                    "--no-color",
                    "--differences",
                    "--errexit",
                    "--chgexit",
                    "--no-title",
                    "--no-wrap",
                    "--precise",
                    "--exec",
                ],
            },
            args,
            |p| {
                let rest = &args[p.operands.min(args.len())..];
                if p.seen.contains('x') || p.long.iter().any(|l| l == "--exec") {
                    command_at(rest, 0)
                } else if rest.is_empty() {
                    Vec::new()
                } else {
                    vec![joined(rest)]
                }
            },
        ),
        "flock" => flock(args),
        "strace" | "ltrace" => with(
            &Opts {
                short_arg: "abeEIoOpPsSuUXA",
                short_flag: "cCdDfFhiknqrtTvVwxyYzL",
                long_arg: &["--output", "--signal", "--trace", "--user"],
                long_flag: &["--follow-forks", "--summary-only"],
            },
            args,
            |p| command_at(args, p.operands),
        ),
        "chroot" => with(
            &Opts {
                short_arg: "",
                short_flag: "",
                long_arg: &["--userspec", "--groups"],
                long_flag: &["--skip-chdir"],
            },
            args,
            |p| command_at(args, p.operands + 1),
        ),
        "nsenter" | "unshare" => with(
            &Opts {
                short_arg: "tSGw",
                short_flag: "aimnpuUCTrfFZc",
                long_arg: &["--target", "--setuid", "--setgid", "--wd"],
                long_flag: &[
                    "--all",
                    "--mount",
                    "--uts",
                    "--ipc",
                    "--net",
                    "--pid",
                    "--user",
                    "--cgroup",
                    "--time",
                    "--fork",
                    "--map-root-user",
                    "--map-current-user",
                    "--preserve-credentials",
                    "--kill-child",
                    "--mount-proc",
                ],
            },
            args,
            |p| command_at(args, p.operands),
        ),
        "busybox" | "toybox" => command_at(args, 0),
        "sshpass" => with(
            &Opts {
                short_arg: "pfdeP",
                short_flag: "v",
                long_arg: &[],
                long_flag: &[],
            },
            args,
            |p| command_at(args, p.operands),
        ),
        "ssh" => with(
            &Opts {
                short_arg: "BbcDEeFIiJLlmOopQRSWw",
                short_flag: "46AaCfGgKkMNnqsTtVvXxYy",
                long_arg: &[],
                long_flag: &[],
            },
            args,
            |p| {
                let rest = &args[(p.operands + 1).min(args.len())..];
                if rest.is_empty() {
                    Vec::new()
                } else {
                    vec![joined(rest)]
                }
            },
        ),
        "trap" => {
            let first = args.first().map(|w| &w.arg);
            match first {
                Some(Arg::Lit(s)) if s.starts_with('-') => {
                    if s == "--" && args.len() > 1 {
                        vec![script_of(&args[1].arg)]
                    } else {
                        Vec::new()
                    }
                }
                Some(a) if args.len() > 1 => vec![script_of(a)],
                _ => Vec::new(),
            }
        }
        "source" | "." => match args.first().map(|w| &w.arg) {
            // `. ~/venv/bin/activate`: a file under the home directory.
            Some(Arg::Unknown { .. })
                if args[0].raw.starts_with("~/") && !args[0].raw.contains(['$', '`', '<']) =>
            {
                Vec::new()
            }
            Some(Arg::Unknown { .. }) => {
                vec![Inner::Unknown("a sourced script not known before it runs")]
            }
            Some(Arg::Lit(s)) if s.starts_with("/dev/") || s.starts_with("/proc/") => {
                vec![Inner::Unknown("a sourced script read from a stream")]
            }
            _ => Vec::new(),
        },
        _ => return None,
    })
}

/// `bash [opts] -c STRING [name args]`, `bash [opts] FILE`, or `bash` reading stdin.
fn shell(args: &[WordVal]) -> Vec<Inner> {
    let mut dash_c = false;
    let mut from_stdin = false;
    let mut i = 0;
    while i < args.len() {
        let Some(a) = args[i].lit() else {
            if dash_c {
                // The script itself (`sh -c "$CMD"`).
                break;
            }
            return vec![Inner::Unknown("a shell option not known before it runs")];
        };
        if a == "--" || a == "-" {
            i += 1;
            break;
        }
        if a.starts_with("--") {
            if matches!(a, "--rcfile" | "--init-file") {
                i += 1;
            }
            i += 1;
            continue;
        }
        if a.len() > 1 && (a.starts_with('-') || a.starts_with('+')) {
            dash_c |= a.starts_with('-') && a.contains('c');
            from_stdin |= a.contains('s');
            if a.contains(['o', 'O']) {
                i += 1;
            }
            i += 1;
            continue;
        }
        break;
    }
    match args.get(i) {
        Some(w) if dash_c => vec![script_of(&w.arg)],
        _ if dash_c => Vec::new(),
        // `bash /dev/stdin <<< …`: a script file that is a stream.
        Some(w) if !from_stdin => match w.lit() {
            Some("/dev/stdin" | "/dev/fd/0" | "/proc/self/fd/0") => vec![Inner::Stdin],
            Some(f) if f.starts_with("/dev/") || f.starts_with("/proc/") => {
                vec![Inner::Unknown("a shell script read from a stream")]
            }
            Some(_) => Vec::new(),
            // Could be /dev/stdin: as a shell reading stdin (nothing there under exec_bash).
            None => vec![Inner::Stdin],
        },
        _ => vec![Inner::Stdin],
    }
}

fn env(args: &[WordVal]) -> Vec<Inner> {
    let o = Opts {
        short_arg: "uCS",
        short_flag: "i0v",
        long_arg: &["--unset", "--chdir", "--split-string"],
        long_flag: &[
            "--ignore-environment",
            "--null",
            "--debug",
            "--default-signal",
            "--ignore-signal",
            "--block-signal",
            "--list-signal-handling",
        ],
    };
    // `env -` is `env -i`.
    let start = usize::from(args.first().and_then(WordVal::lit) == Some("-"));
    let args = &args[start..];
    with(&o, args, |p| {
        let rest = skip_assignments(&args[p.operands.min(args.len())..]);
        let split = p.value('S', "--split-string");
        match split {
            // `env -S 'rm -rf /'`: the string is split into the command's first words.
            Some(Arg::Lit(s)) => {
                let mut text = s.clone();
                for w in rest {
                    text.push(' ');
                    text.push_str(&w.raw);
                }
                vec![Inner::Script(text)]
            }
            Some(Arg::Unknown { .. }) => {
                vec![Inner::Unknown(
                    "env -S with a string not known before it runs",
                )]
            }
            None => command_at(rest, 0),
        }
    })
}

fn nice(args: &[WordVal]) -> Vec<Inner> {
    // `nice -5 cmd` / `nice -n 5 cmd` / `nice --adjustment=5 cmd`.
    let at = match args.first().and_then(WordVal::lit) {
        Some(a)
            if a.len() > 1 && a.starts_with('-') && a[1..].chars().all(|c| c.is_ascii_digit()) =>
        {
            1
        }
        _ => 0,
    };
    let rest = &args[at..];
    with(
        &Opts {
            short_arg: "n",
            short_flag: "",
            long_arg: &["--adjustment"],
            long_flag: &[],
        },
        rest,
        |p| command_at(rest, p.operands),
    )
}

/// `su [opts] [-] [user] [-c STR]`, `runuser … [-c STR]` / `runuser -u USER CMD…`,
/// `script [opts] [-c STR] [file]`, `sg GROUP [-c] STR…`: options may come after the
/// operands (`su - root -c …`), clustered (`su -lc …`, `script -qc …`) or long
/// (`--command=…`, `--session-command …`). Without a command, su, runuser and script start a
/// shell that reads its script from stdin.
fn dash_c(name: &str, args: &[WordVal]) -> Vec<Inner> {
    if name == "sg" {
        let rest = args.get(1..).unwrap_or_default();
        let rest = match rest.first().and_then(WordVal::lit) {
            Some("-c") => &rest[1..],
            _ => rest,
        };
        return if rest.is_empty() {
            Vec::new()
        } else {
            vec![joined(rest)]
        };
    }
    let o = match name {
        "script" => Opts {
            short_arg: "cEIOBTm",
            short_flag: "aefqtVh",
            long_arg: &[
                "--command",
                "--echo",
                "--log-in",
                "--log-out",
                "--log-io",
                "--log-timing",
                "--logging-format",
                "--output-limit",
            ],
            long_flag: &[
                "--append",
                "--return",
                "--flush",
                "--force",
                "--quiet",
                "--timing",
                "--version",
                "--help",
            ],
        },
        _ => Opts {
            short_arg: "cgGswuC",
            short_flag: "flmpPhV",
            long_arg: &[
                "--command",
                "--session-command",
                "--group",
                "--supp-group",
                "--shell",
                "--whitelist-environment",
                "--user",
            ],
            long_flag: &[
                "--login",
                "--preserve-environment",
                "--pty",
                "--fast",
                "--help",
                "--version",
            ],
        },
    };
    // Options anywhere: parse each run of them between operands.
    let mut operands: Vec<usize> = Vec::new();
    let mut command = None;
    let mut user_flag = false;
    let mut i = 0;
    while i < args.len() {
        match args[i].lit() {
            Some("-") => i += 1,
            Some("--") => {
                operands.extend(i + 1..args.len());
                break;
            }
            Some(a) if a.starts_with('-') => {
                // A run of options, up to the next operand.
                let p = match parse(&o, &args[i..]) {
                    Ok(p) => p,
                    Err(why) => return vec![Inner::Unknown(why)],
                };
                if let Some(c) = p
                    .value('c', "--command")
                    .or(p.long_value("--session-command"))
                {
                    command = Some(c.clone());
                }
                user_flag |= p.seen.contains('u') || p.long.iter().any(|l| l == "--user");
                let end = i + p.operands.max(1);
                if args[i..end].last().and_then(WordVal::lit) == Some("--") {
                    operands.extend(end..args.len());
                    break;
                }
                i = end;
            }
            Some(_) => {
                operands.push(i);
                i += 1;
            }
            None => return vec![Inner::Unknown("a wrapper option not known before it runs")],
        }
    }
    if let Some(c) = command {
        return vec![script_of(&c)];
    }
    match name {
        // `runuser -u USER CMD…`: the operands are the command.
        "runuser" if user_flag => match operands.first() {
            Some(&at) => command_at(args, at),
            None => vec![Inner::Stdin],
        },
        // `script FILE` records a shell; `su USER` and `runuser USER` start one.
        _ => vec![Inner::Stdin],
    }
}

fn xargs(args: &[WordVal]) -> Vec<Inner> {
    let o = Opts {
        short_arg: "adEILnPs",
        short_flag: "0oprtxeil",
        long_arg: &[
            "--arg-file",
            "--delimiter",
            "--max-lines",
            "--max-args",
            "--max-procs",
            "--max-chars",
            "--process-slot-var",
        ],
        long_flag: &[
            "--null",
            "--open-tty",
            "--interactive",
            "--no-run-if-empty",
            "--verbose",
            "--exit",
            "--show-limits",
            "--replace",
            "--eof",
        ],
    };
    with(&o, args, |p| {
        let rest = &args[p.operands.min(args.len())..];
        if rest.is_empty() {
            return Vec::new();
        }
        // `-I R` / `-i` / `--replace[=R]`: each R in the command becomes a line of input, so
        // a word holding it (a `sh -c '… R …'` script too) is only known when it runs.
        let replace = match p.value('I', "--replace") {
            Some(Arg::Lit(r)) => Some(r.clone()),
            Some(Arg::Unknown { .. }) => {
                return vec![Inner::Unknown(
                    "xargs -I with a replace string not known before it runs",
                )];
            }
            None if p.seen.contains('i') || p.long.iter().any(|l| l == "--replace") => {
                Some("{}".to_string())
            }
            None => None,
        };
        if let Some(r) = replace.filter(|r| !r.is_empty()) {
            return vec![Inner::Command(replaced(rest, |s| s.contains(r.as_str())))];
        }
        // Its input becomes more arguments, any number of them.
        let mut ws = words(rest);
        ws.push(WordVal::unknown(true));
        vec![Inner::Command(ws)]
    })
}

/// `words` with each one `holds` says is replaced by input as unknown.
fn replaced(words: &[WordVal], holds: impl Fn(&str) -> bool) -> Vec<WordVal> {
    words
        .iter()
        .map(|w| match w.lit() {
            Some(s) if holds(s) => WordVal::unknown(false),
            _ => w.clone(),
        })
        .collect()
}

/// `find … -exec CMD {} ;` (also `-execdir`, `-ok`, `-okdir`, `+`-terminated). `{}` is a
/// path found under the start paths: relative when they all are (`find . -exec rm {} +`
/// removes `./…`, never `/…`), and always for `-execdir`; else unknown.
fn find(args: &[WordVal]) -> Vec<Inner> {
    let starts = args
        .iter()
        .take_while(|w| !w.lit().is_some_and(|s| s.starts_with(['-', '(', '!'])));
    let relative = starts
        .clone()
        .all(|w| w.lit().is_some_and(|s| !s.starts_with('/')));
    let mut out = Vec::new();
    let mut i = 0;
    while i < args.len() {
        if let Some(action @ ("-exec" | "-execdir" | "-ok" | "-okdir")) = args[i].lit() {
            let dir = action.ends_with("dir");
            let start = i + 1;
            let mut end = start;
            while end < args.len() && !matches!(args[end].lit(), Some(";" | "+")) {
                end += 1;
            }
            let ws: Vec<WordVal> = args[start..end]
                .iter()
                .map(|w| match w.lit() {
                    Some(s) if s.contains("{}") && (relative || dir) && s == "{}" => WordVal {
                        arg: Arg::Lit("./{}".to_string()),
                        ..w.clone()
                    },
                    Some(s) if s.contains("{}") => WordVal::unknown(false),
                    _ => w.clone(),
                })
                .collect();
            if !ws.is_empty() {
                out.push(Inner::Command(ws));
            }
            i = end;
        }
        i += 1;
    }
    out
}

/// `flock [opts] FILE CMD…`, `flock [opts] FILE -c STR`, `flock [opts] FD`.
fn flock(args: &[WordVal]) -> Vec<Inner> {
    if let Some(i) = args
        .iter()
        .position(|w| matches!(w.lit(), Some("-c" | "--command")))
    {
        return match args.get(i + 1) {
            Some(s) => vec![script_of(&s.arg)],
            None => Vec::new(),
        };
    }
    with(
        &Opts {
            short_arg: "wE",
            short_flag: "sexnuoFh",
            long_arg: &["--timeout", "--conflict-exit-code"],
            long_flag: &[
                "--shared",
                "--exclusive",
                "--nonblock",
                "--unlock",
                "--close",
                "--no-fork",
                "--verbose",
            ],
        },
        args,
        |p| command_at(args, p.operands + 1),
    )
}
