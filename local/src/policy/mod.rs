//! The command policy (issue 23): `deny` and `ask` rules over every simple command of the
//! bash an agent asks rsb to run, global and per sandbox, off until a rule is configured.
//!
//! A guard-rail for an agent, not a security boundary: a shell user on the sandbox is not
//! stopped by it, and a program that runs code its own way (`python -c`, a script file, a
//! Makefile) is not looked into. What it does promise is that the ways bash itself offers to
//! spell a command (quotes, escapes, `$(…)`, `eval`, `bash -c`, wrappers, aliases) do not get
//! past a rule, and that what cannot be known before bash runs counts as matching, so the
//! policy fails closed ([`shell`]).
//!
//! A rule is words: the first is a glob over the command name (its basename, unless the
//! glob holds a `/`), each further one must match some argument, in any order; a word like
//! `-rf` is a set of short flags (`-r -f`, `-fr`, `-rfv` all hold it). Asking is the caller's
//! ([`gate`] takes how): MCP elicitation in `mcp/`, a terminal prompt in the CLI. Every
//! decision that stops or asks is one audit line.

mod evaluated;
mod glob;
pub mod shell;
mod words;
mod wrappers;

use std::future::Future;

use serde_json::json;

pub use crate::config::{PolicyAction as Action, PolicyRules};
use crate::{
    config::Config,
    error::{Kind, RsbError},
};
use words::{Arg, Simple};

/// One configured rule.
#[derive(Clone, Debug)]
pub struct Rule {
    /// As written in the configuration; what messages and the audit log name.
    pub text: String,
    name: String,
    args: Vec<ArgPat>,
}

#[derive(Clone, Debug)]
enum ArgPat {
    /// `-rf`: each letter must be among the command's short options.
    Flags(Vec<char>),
    Glob(String),
}

impl Rule {
    /// `None` for a blank rule.
    pub fn parse(text: &str) -> Option<Rule> {
        let mut words = text.split_whitespace();
        let name = words.next()?.to_string();
        let args = words
            .map(|w| {
                let letters = w.strip_prefix('-').filter(|l| {
                    !l.is_empty()
                        && !l.starts_with('-')
                        && l.chars().all(|c| c.is_ascii_alphanumeric())
                });
                match letters {
                    Some(l) => ArgPat::Flags(l.chars().collect()),
                    None => ArgPat::Glob(w.to_string()),
                }
            })
            .collect();
        Some(Rule {
            text: text.trim().to_string(),
            name,
            args,
        })
    }

    /// Could `c` be what this rule names? Unknown words match anything.
    pub fn matches(&self, c: &Simple) -> bool {
        let Some(first) = c.words.first() else {
            return false;
        };
        let name_ok = match first {
            Arg::Lit(n) => {
                glob::matches(&self.name, n)
                    || (!self.name.contains('/')
                        && glob::matches(&self.name, n.rsplit('/').next().unwrap_or(n)))
            }
            Arg::Unknown { .. } => true,
        };
        if !name_ok {
            return false;
        }
        // An unquoted unknown name may expand into the name and arguments alike.
        let args = &c.words[1..];
        let unknown = matches!(first, Arg::Unknown { many: true })
            || args.iter().any(|a| matches!(a, Arg::Unknown { .. }));
        if unknown {
            return true;
        }
        let lits: Vec<&str> = args.iter().filter_map(Arg::lit).collect();
        self.args.iter().all(|p| match p {
            ArgPat::Flags(want) => {
                let have = short_flags(&lits);
                want.iter().all(|f| have.contains(f))
            }
            ArgPat::Glob(g) => lits.iter().any(|a| {
                glob::matches(g, a) || normalized(a).is_some_and(|n| glob::matches(g, &n))
            }),
        })
    }
}

/// An argument's absolute path spelt the short way, when it is spelt otherwise: `//dev/sda`,
/// `/tmp/./x` and `/tmp/../home/x` name `/dev/sda`, `/tmp/x` and `/home/x` to the kernel (`..`
/// read lexically, which a symlinked directory could change: a rule then still matches the
/// spelling given). Also after `NAME=` (`of=//dev/sda`). `None` when already short or not a
/// path.
fn normalized(arg: &str) -> Option<String> {
    let (prefix, path) = match arg.find('=') {
        Some(i) if arg[i + 1..].starts_with('/') => arg.split_at(i + 1),
        _ => ("", arg),
    };
    if !path.starts_with('/') {
        return None;
    }
    let mut parts: Vec<&str> = Vec::new();
    for p in path.split('/') {
        match p {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            p => parts.push(p),
        }
    }
    let trailing = path.len() > 1 && path.ends_with('/') && !parts.is_empty();
    let short = format!(
        "{prefix}/{}{}",
        parts.join("/"),
        if trailing { "/" } else { "" }
    );
    (short != arg).then_some(short)
}

/// The letters of the short options before `--` (`-r -f x -v` → `rfv`).
fn short_flags(args: &[&str]) -> Vec<char> {
    args.iter()
        .take_while(|a| **a != "--")
        .filter(|a| a.len() > 1 && a.starts_with('-') && !a.starts_with("--"))
        .flat_map(|a| a[1..].chars())
        .collect()
}

/// Where a command stopped or asked, for the reply and the audit line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finding {
    /// The rule's text; `None`: no rule, a command name only known at run time.
    pub rule: Option<String>,
    /// The simple command that matched, unknown words as `…`.
    pub command: String,
    /// The command name (or the whole command) is only known when bash runs it.
    pub unknown: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    Allow,
    Ask(Finding),
    Deny(Finding),
}

/// The rules that apply on one sandbox: the global ones and the sandbox's own.
#[derive(Clone, Debug, Default)]
pub struct Policy {
    deny: Vec<Rule>,
    ask: Vec<Rule>,
    actions: Vec<Action>,
}

impl Policy {
    pub fn new(rules: &[&PolicyRules]) -> Policy {
        let mut p = Policy::default();
        for r in rules {
            p.deny.extend(r.deny.iter().filter_map(|t| Rule::parse(t)));
            p.ask.extend(r.ask.iter().filter_map(|t| Rule::parse(t)));
            p.actions.extend(r.ask_actions.iter().copied());
        }
        p
    }

    pub fn for_sandbox(config: &Config, sandbox: &str) -> Policy {
        let mut rules = vec![&config.policy];
        if let Some(sb) = config.sandbox(sandbox) {
            rules.push(&sb.policy);
        }
        Policy::new(&rules)
    }

    /// No command rules (rsb's own actions are asked about apart: [`Policy::asks`]).
    pub fn is_empty(&self) -> bool {
        self.deny.is_empty() && self.ask.is_empty()
    }

    /// Does `action` need the user's approval on this sandbox?
    pub fn asks(&self, action: Action) -> bool {
        self.actions.contains(&action)
    }

    /// The strictest decision over every simple command of `script`: a deny anywhere wins;
    /// else the first ask (by rule, or a command name only known at run time).
    pub fn check(&self, script: &str) -> Decision {
        self.check_with(script, false)
    }

    /// [`Policy::check`] of a script whose stdin is data the caller forwards (`… | rsb exec
    /// sb bash`): a shell reading it runs code nobody saw.
    pub fn check_with(&self, script: &str, stdin_forwarded: bool) -> Decision {
        if self.is_empty() {
            return Decision::Allow;
        }
        let programs: Vec<String> = self
            .deny
            .iter()
            .chain(&self.ask)
            .map(|r| r.name.clone())
            .collect();
        let mut ask = None;
        for c in shell::commands_for(script, &programs, stdin_forwarded) {
            let finding = |rule: Option<&Rule>| Finding {
                rule: rule.map(|r| r.text.clone()),
                command: c.display(),
                unknown: matches!(c.words.first(), Some(Arg::Unknown { .. })),
            };
            if let Some(r) = self.deny.iter().find(|r| r.matches(&c)) {
                return Decision::Deny(finding(Some(r)));
            }
            if ask.is_none() {
                if let Some(r) = self.ask.iter().find(|r| r.matches(&c)) {
                    ask = Some(finding(Some(r)));
                } else if matches!(c.words.first(), Some(Arg::Unknown { .. })) {
                    ask = Some(finding(None));
                }
            }
        }
        ask.map(Decision::Ask).unwrap_or(Decision::Allow)
    }
}

/// What the user said to an `ask`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer {
    Approved,
    Declined,
    /// Dismissed without a choice, or the question could not be delivered.
    Cancelled,
    /// Nobody can be asked here (an MCP client without elicitation, no terminal); the text
    /// says why, for the refusal.
    CannotAsk(String),
}

/// Who is running what, for the audit line of a decision.
/// What a `sudo: true` / `rsb exec --sudo` call runs, as the policy checks it: `sudo -- bash -c
/// 'COMMAND'`, so a rule naming sudo applies and the command inside is still walked (the
/// agent runs it as `sudo -S -- bash -c "$1"` with the command as data).
pub fn as_sudo(command: &str) -> String {
    format!("sudo -- bash -c '{}'", command.replace('\'', r"'\''"))
}

pub struct Request<'a> {
    pub sandbox: &'a str,
    /// `mcp:<client>` or `cli`.
    pub origin: String,
    pub tool: &'a str,
    /// The commands the call would run, each with the parameter it came in (`command`,
    /// `resume_command`, `resume_plan_json.checkpoint_command`, ...).
    pub commands: Vec<(&'a str, &'a str)>,
    pub cwd: Option<&'a str>,
    /// The caller's stdin reaches the command (`… | rsb exec sb bash`): a shell reading its
    /// script from it runs code nobody saw.
    pub stdin_forwarded: bool,
}

/// Check every command of `req` against the sandbox's policy; ask through `ask` when a rule
/// says so. `Ok` means run. Each deny and each answer is an audit line.
pub async fn gate<F, Fut>(config: &Config, req: &Request<'_>, ask: F) -> Result<(), RsbError>
where
    F: FnOnce(String) -> Fut,
    Fut: Future<Output = Answer>,
{
    let policy = Policy::for_sandbox(config, req.sandbox);
    if policy.is_empty() {
        return Ok(());
    }
    let mut asks: Vec<(&str, &str, Finding)> = Vec::new();
    for &(field, c) in &req.commands {
        match policy.check_with(c, req.stdin_forwarded) {
            Decision::Allow => {}
            Decision::Deny(f) => {
                record(config, req, c, "deny", &f);
                return Err(denied(&f));
            }
            Decision::Ask(f) => asks.push((field, c, f)),
        }
    }
    if asks.is_empty() {
        return Ok(());
    }
    let answer = ask(question(req, &asks)).await;
    let f = &asks[0].2;
    let (word, result) = match answer {
        Answer::Approved => ("approved", Ok(())),
        Answer::Declined => ("declined", Err(declined(f, "the user declined it"))),
        Answer::Cancelled => ("cancelled", Err(declined(f, "the approval was cancelled"))),
        Answer::CannotAsk(why) => ("not_asked", Err(cannot_ask(f, &why))),
    };
    for (_, command, f) in &asks {
        record(config, req, command, word, f);
    }
    result
}

/// One of rsb's own destructive operations, about to happen.
pub struct ActionRequest<'a> {
    pub sandbox: &'a str,
    /// `mcp:<client>` or `cli`.
    pub origin: String,
    pub tool: &'a str,
    pub action: Action,
    /// What it would destroy, in a line or a few: the user decides from this.
    pub what: String,
}

/// Does the policy of `sandbox` put `action` behind an approval? A caller that must work out
/// what the action would destroy (a sync's dry run) asks this first, so an unguarded sync
/// pays nothing.
pub fn asks(config: &Config, sandbox: &str, action: Action) -> bool {
    Policy::for_sandbox(config, sandbox).asks(action)
}

/// Ask the user through `ask` whether `req.action` may go ahead, if the sandbox's policy says
/// so; `Ok` means go ahead. The answer is an audit line.
pub async fn gate_action<F, Fut>(
    config: &Config,
    req: &ActionRequest<'_>,
    ask: F,
) -> Result<(), RsbError>
where
    F: FnOnce(String) -> Fut,
    Fut: Future<Output = Answer>,
{
    if !asks(config, req.sandbox, req.action) {
        return Ok(());
    }
    let name = req.action.as_str();
    let question = format!(
        "rsb: allow {name} on sandbox '{}' ({})? The policy asks before it.\n\n{}",
        req.sandbox, req.tool, req.what
    );
    let (word, result) = match ask(question).await {
        Answer::Approved => ("approved", Ok(())),
        Answer::Declined => (
            "declined",
            Err(action_declined(name, "the user declined it")),
        ),
        Answer::Cancelled => (
            "cancelled",
            Err(action_declined(name, "the approval was cancelled")),
        ),
        Answer::CannotAsk(why) => ("not_asked", Err(action_cannot_ask(name, &why))),
    };
    crate::audit::record(
        config,
        req.sandbox,
        &crate::audit::Action {
            origin: req.origin.clone(),
            tool: req.tool.to_string(),
            command: Some(req.what.clone()),
            detail: Some(json!({ "policy": word, "action": name })),
            ..Default::default()
        },
    );
    result
}

fn action_declined(name: &str, why: &str) -> RsbError {
    RsbError::new(
        Kind::Policy,
        format!("policy: {name} not done, {why} (ask_actions \"{name}\")"),
        "nothing was changed; ask the user, or do it without this option",
    )
}

/// Nobody could be asked, so the hint says how to allow it instead.
fn action_cannot_ask(name: &str, why: &str) -> RsbError {
    RsbError::new(
        Kind::Policy,
        format!("policy: {name} needs the user's approval, and {why}"),
        format!(
            "nothing was changed; use a client that supports MCP elicitation, or the CLI from a \
             terminal (--yes approves), or remove \"{name}\" from [policy] ask_actions \
             (RSB_POLICY_ASK_ACTIONS, or the sandbox's policy)"
        ),
    )
}

/// What the user is asked: the sandbox, and every command of the call that needs approval,
/// whole and with the simple command each rule matched, escaped for a terminal (a command
/// holding an escape sequence must not redraw the question it appears in).
fn question(req: &Request<'_>, asks: &[(&str, &str, Finding)]) -> String {
    let mut q = format!(
        "rsb: run this on sandbox '{}' ({})? The policy asks before {}.",
        crate::term::shown(req.sandbox),
        req.tool,
        if asks.len() == 1 {
            "it".to_string()
        } else {
            format!("{} of its commands", asks.len())
        }
    );
    for (field, command, f) in asks {
        let why = match &f.rule {
            Some(r) => format!("matches the ask rule \"{}\"", crate::term::shown(r)),
            None => "its command name is only known when it runs".to_string(),
        };
        q.push_str(&format!(
            "\n\n{field}:\n{}\n({why}: `{}`)",
            crate::term::shown_lines(command),
            crate::term::shown(&f.command)
        ));
    }
    q
}

fn what(f: &Finding) -> String {
    if f.unknown {
        format!(
            "`{}`, whose command is only known when it runs, so it counts as matching",
            f.command
        )
    } else {
        format!("`{}`", f.command)
    }
}

fn denied(f: &Finding) -> RsbError {
    RsbError::new(
        Kind::Policy,
        format!(
            "policy: denied by rule \"{}\": {}",
            f.rule.as_deref().unwrap_or_default(),
            what(f)
        ),
        "a deny rule cannot be approved; run a command that does not match it, or change the \
         rule in [policy] deny of the config (global or the sandbox's policy)",
    )
}

fn declined(f: &Finding, why: &str) -> RsbError {
    RsbError::new(
        Kind::Policy,
        format!("policy: not run, {why} ({}: {})", rule_name(f), what(f)),
        "nothing ran; ask the user, or run a command that needs no approval",
    )
}

fn cannot_ask(f: &Finding, why: &str) -> RsbError {
    RsbError::new(
        Kind::Policy,
        format!(
            "policy: this command needs the user's approval ({}: {}), and {why}",
            rule_name(f),
            what(f)
        ),
        "nothing ran; use a client that supports MCP elicitation, or `rsb exec` from a \
         terminal, or allow it by removing the rule from [policy] ask of the config \
         (RSB_POLICY_ASK, or the sandbox's policy)",
    )
}

fn rule_name(f: &Finding) -> String {
    match &f.rule {
        Some(r) => format!("ask rule \"{r}\""),
        None => "a command name only known at run time".to_string(),
    }
}

/// The audit line of a decision: the tool, the command as given, and `detail.policy`
/// (`deny`, `approved`, `declined`, `cancelled`, `not_asked`) with the rule and the simple
/// command that matched.
fn record(config: &Config, req: &Request<'_>, command: &str, decision: &str, f: &Finding) {
    crate::audit::record(
        config,
        req.sandbox,
        &crate::audit::Action {
            origin: req.origin.clone(),
            tool: req.tool.to_string(),
            command: Some(command.to_string()),
            cwd: req.cwd.map(str::to_string),
            detail: Some(json!({
                "policy": decision,
                "rule": f.rule,
                "matched": f.command,
            })),
            ..Default::default()
        },
    );
}

#[cfg(test)]
mod tests;
