//! Progress of the long operations (`purge`, `evict --all`): the count so
//! far, the rate per second and the time elapsed, on standard error, and
//! only on a terminal (hidden when standard error is a pipe or a file, and
//! under `--format json`).

use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Counting with no known total: "⠙ purging expired records: 12,500 records, 4,180/s, 3s".
const COUNTING: &str = "{spinner} {msg}: {human_pos} records, {per_sec}, {elapsed}";
/// Counting towards a total: "⠙ evicting [####    ] 40/100 records, 12/s, 3s (eta 5s)".
const BOUNDED: &str =
    "{spinner} {msg} [{bar:30}] {human_pos}/{human_len} records, {per_sec}, {elapsed} (eta {eta})";

/// Whether progress is drawn: on a terminal, and not for scripts.
pub(crate) fn visible(json: bool) -> bool {
    !json && std::io::stderr().is_terminal()
}

/// A progress line counting records with no known total.
pub(crate) fn counting(message: &str, visible: bool) -> ProgressBar {
    styled(ProgressBar::no_length(), COUNTING, message, visible)
}

/// A progress bar counting records towards `total`.
pub(crate) fn bounded(total: u64, message: &str, visible: bool) -> ProgressBar {
    styled(ProgressBar::new(total), BOUNDED, message, visible)
}

fn styled(bar: ProgressBar, template: &str, message: &str, visible: bool) -> ProgressBar {
    if !visible {
        bar.set_draw_target(ProgressDrawTarget::hidden());
        return bar;
    }
    bar.set_draw_target(ProgressDrawTarget::stderr());
    apply(&bar, template, message);
    // Moves while a call to the store is pending.
    bar.enable_steady_tick(Duration::from_millis(120));
    bar
}

fn apply(bar: &ProgressBar, template: &str, message: &str) {
    if let Ok(style) = ProgressStyle::with_template(template) {
        bar.set_style(style.progress_chars("#>-"));
    }
    bar.set_message(message.to_owned());
}

#[cfg(test)]
mod tests {
    use std::io;
    use std::sync::{Arc, Mutex};

    use indicatif::TermLike;

    use super::*;

    /// A terminal that records what is written to it.
    #[derive(Debug, Clone, Default)]
    struct Recorder(Arc<Mutex<String>>);

    impl TermLike for Recorder {
        fn width(&self) -> u16 {
            120
        }
        fn move_cursor_up(&self, _: usize) -> io::Result<()> {
            Ok(())
        }
        fn move_cursor_down(&self, _: usize) -> io::Result<()> {
            Ok(())
        }
        fn move_cursor_right(&self, _: usize) -> io::Result<()> {
            Ok(())
        }
        fn move_cursor_left(&self, _: usize) -> io::Result<()> {
            Ok(())
        }
        fn write_line(&self, s: &str) -> io::Result<()> {
            self.write_str(s)
        }
        fn write_str(&self, s: &str) -> io::Result<()> {
            if let Ok(mut out) = self.0.lock() {
                out.push_str(s);
                out.push('\n');
            }
            Ok(())
        }
        fn clear_line(&self) -> io::Result<()> {
            Ok(())
        }
        fn flush(&self) -> io::Result<()> {
            Ok(())
        }
    }

    fn rendered(bar: &ProgressBar, term: &Recorder) -> String {
        bar.tick();
        term.0.lock().map(|s| s.clone()).unwrap_or_default()
    }

    #[test]
    fn progress_shows_the_count_the_rate_and_the_time() {
        for (template, total) in [(COUNTING, None), (BOUNDED, Some(5000))] {
            let term = Recorder::default();
            let bar = total.map_or_else(ProgressBar::no_length, ProgressBar::new);
            bar.set_draw_target(ProgressDrawTarget::term_like(Box::new(term.clone())));
            apply(&bar, template, "purging");
            bar.set_position(1234);
            let line = rendered(&bar, &term);
            assert!(line.contains("purging"), "{line}");
            assert!(line.contains("1,234"), "the count: {line}");
            assert!(line.contains("/s"), "the rate: {line}");
            assert!(line.contains("0s"), "the time elapsed: {line}");
            if total.is_some() {
                assert!(line.contains("1,234/5,000"), "{line}");
            }
        }
    }

    #[test]
    fn hidden_unless_asked_for() {
        assert!(counting("x", false).is_hidden());
        assert!(bounded(3, "x", false).is_hidden());
        assert!(!visible(true));
    }
}
