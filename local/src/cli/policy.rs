//! The policy's `ask` on the command line: a y/N question on the terminal, `--yes` to
//! approve without one, and a refusal where nobody can answer (no terminal).

use std::{
    io::{BufRead, IsTerminal, Write},
    sync::Arc,
};

use rsb::{ops::action::Caller, policy::Answer};

/// The command line's side of an action ([`rsb::ops::action`]): origin `cli`, and the user
/// asked on the terminal (or `--yes`).
pub fn caller(yes: bool) -> Caller {
    Caller::new(
        "cli",
        Arc::new(move |question| Box::pin(terminal(question, yes))),
    )
}

/// The answer from the terminal, or `--yes`.
pub async fn terminal(question: String, yes: bool) -> Answer {
    if yes {
        return Answer::Approved;
    }
    tokio::task::spawn_blocking(move || prompt(&question))
        .await
        .unwrap_or(Answer::Cancelled)
}

fn prompt(question: &str) -> Answer {
    if !std::io::stdin().is_terminal() || !std::io::stderr().is_terminal() {
        return Answer::CannotAsk(
            "stdin is not a terminal, so nobody can be asked (--yes approves it)".into(),
        );
    }
    let mut err = std::io::stderr().lock();
    let _ = write!(err, "{question}\nRun it? [y/N] ");
    let _ = err.flush();
    let mut line = String::new();
    match std::io::stdin().lock().read_line(&mut line) {
        Ok(0) | Err(_) => Answer::Cancelled,
        Ok(_) if matches!(line.trim(), "y" | "Y" | "yes" | "YES" | "Yes") => Answer::Approved,
        Ok(_) => Answer::Declined,
    }
}
