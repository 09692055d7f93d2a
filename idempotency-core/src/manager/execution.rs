//! Stages 1 to 3 of one execution (contract §4) under the manager: the
//! reservation's answer, the handler under its lease, the outcome recorded;
//! and what a duplicate gets.

use super::*;

impl<C: Codec + Clone> IdempotencyManager<C> {
    /// Stage 1, then stages 2 and 3 under the lease.
    pub(super) async fn run<T, E, F, Fut>(
        &self,
        key: RecordKey,
        fingerprint: Option<Fingerprint>,
        handler: F,
    ) -> Result<Outcome<T>, ExecuteError<E>>
    where
        T: Serialize + DeserializeOwned,
        E: fmt::Display,
        F: FnOnce(ExecutionContext) -> Fut,
        Fut: Future<Output = Result<T, HandlerError<E>>>,
    {
        let engine = &*self.engine;
        if let Some(decision) = engine.cached_answer(&key, fingerprint.as_ref()) {
            engine.metrics.count(Counter::DuplicatesBlocked);
            return self.answer_duplicate(&key, decision);
        }
        let lease = Arc::new(Lease::new(key, OwnerToken::random()));
        let guard = ExecutionGuard::new(self.engine.clone(), lease.clone());
        let reserved = engine.reserve(&lease, fingerprint).await;
        self.after_reserve(guard, reserved, fingerprint, handler, None)
            .await
    }

    /// Stage 1's answer, then stages 2 and 3 under the lease; a batch item's
    /// completion goes with its group's (`batch`).
    pub(super) async fn after_reserve<T, E, F, Fut>(
        &self,
        mut guard: ExecutionGuard,
        reserved: Result<Reserved, Error>,
        fingerprint: Option<Fingerprint>,
        handler: F,
        batch: Option<&mut Participant>,
    ) -> Result<Outcome<T>, ExecuteError<E>>
    where
        T: Serialize + DeserializeOwned,
        E: fmt::Display,
        F: FnOnce(ExecutionContext) -> Fut,
        Fut: Future<Output = Result<T, HandlerError<E>>>,
    {
        let engine = &*self.engine;
        let lease = guard.lease.clone();
        match reserved {
            Ok(Reserved::Acquired {
                attempt,
                lease_until,
                sent_at,
                sent,
            }) => {
                lease.set_attempt(attempt);
                lease.confirm(lease_until, sent_at, sent);
                if tokio::time::Instant::now() >= lease.deadline() {
                    // Confirmed only after the lease it asked for ended (slow
                    // or re-sent replies): another consumer may take over at
                    // any moment. The guard releases what is still ours.
                    tracing::warn!("the reservation was confirmed after its lease ended; not running the handler");
                    record_outcome("store_error");
                    return Err(Error::Timeout {
                        backend: engine.caps.backend,
                        operation: "reserve",
                    }
                    .into());
                }
            }
            Ok(Reserved::Duplicate {
                decision,
                unsettled,
            }) => return self.answer_reserved_duplicate(guard, decision, unsettled),
            Err(e)
                if e.is_store_outage()
                    && engine.config.on_store_outage == OutagePolicy::FailOpen
                    && !lease.was_refused() =>
            {
                return self.run_unprotected(guard, e, handler).await;
            }
            Err(e) => {
                // After an outage the guard releases what a lost reply may have
                // created under our token; so it does when an attempt failed
                // ambiguously before this error, or this error came with the
                // attempt's reply (one that did not decode may follow a write).
                // Otherwise nothing is left behind.
                if !e.is_store_outage() && !lease.reserve_may_land() {
                    guard.phase = Phase::Done;
                }
                record_outcome("store_error");
                return Err(e.into());
            }
        }
        engine.metrics.count(Counter::CacheMisses);
        let _active = engine.metrics.active();
        tracing::debug!(attempt = lease.attempt(), "acquired");
        guard.phase = Phase::Running;
        let ctx = ExecutionContext::new(lease.clone());
        if engine.config.lease_extension_interval.is_none() {
            // Nothing to keep beside the handler (see `Engine::under_lease`);
            // awaited in place, the stage's future is not moved.
            return self
                .run_and_record(&mut guard, ctx, fingerprint, handler, batch)
                .await;
        }
        engine
            .under_lease(
                &lease,
                self.run_and_record(&mut guard, ctx, fingerprint, handler, batch),
            )
            .await
    }

    /// Stages 2 and 3: the handler, then its outcome's record.
    pub(super) async fn run_and_record<T, E, F, Fut>(
        &self,
        guard: &mut ExecutionGuard,
        ctx: ExecutionContext,
        fingerprint: Option<Fingerprint>,
        handler: F,
        batch: Option<&mut Participant>,
    ) -> Result<Outcome<T>, ExecuteError<E>>
    where
        T: Serialize + DeserializeOwned,
        E: fmt::Display,
        F: FnOnce(ExecutionContext) -> Fut,
        Fut: Future<Output = Result<T, HandlerError<E>>>,
    {
        let engine = &*self.engine;
        let result = catch_handler(handler, ctx).await;
        // From here the effect may have happened: should encoding the result
        // panic, the guard records the success without it, never releases.
        guard.phase = Phase::Recording(self.effect_happened(&result));
        guard.phase = Phase::Recording(self.pending_for(&result));
        let written_at = engine.answers.as_ref().map(|_| engine.now());
        let deadline = engine.finish_deadline(&guard.lease);
        let finished = engine.finish_guarded(guard, deadline, batch).await;
        // The write as applied (without the result, had the store refused it).
        let was = std::mem::replace(&mut guard.phase, Phase::Done);
        engine.hold_time.observe(guard.lease.held_for());
        if let (
            Some(at),
            Some(expires_at),
            Finished::Applied,
            Phase::Recording(Pending::Complete(result)),
        ) = (written_at, guard.lease.completion_expiry(), &finished, &was)
        {
            // The expiry the store was asked for, not one derived again here:
            // a clock stepped back between the two would outlive the record.
            let (key, result) = (&guard.lease.key, result.clone());
            engine.remember_completion(key, fingerprint, result, at, expires_at);
        }
        match result {
            Ok(Ok(value)) => Ok(self.success_outcome(finished, value)),
            Ok(Err(err)) => {
                report_failure_record(engine, &finished, &was);
                Err(ExecuteError::Handler(err.into_inner()))
            }
            Err(panic) => {
                report_failure_record(engine, &finished, &was);
                std::panic::resume_unwind(panic)
            }
        }
    }

    /// The store was unreachable and the policy is fail-open: run without
    /// protection. A reserve whose reply was lost may have created the record
    /// under our token: the guard completes (or releases) it in the background.
    pub(super) async fn run_unprotected<T, E, F, Fut>(
        &self,
        mut guard: ExecutionGuard,
        error: Error,
        handler: F,
    ) -> Result<Outcome<T>, ExecuteError<E>>
    where
        T: Serialize + DeserializeOwned,
        E: fmt::Display,
        F: FnOnce(ExecutionContext) -> Fut,
        Fut: Future<Output = Result<T, HandlerError<E>>>,
    {
        tracing::warn!(error = %error, "store unavailable; running the handler unprotected (fail-open)");
        self.engine.metrics.count(Counter::FailOpen);
        record_outcome("unprotected");
        guard.phase = Phase::Running;
        let result = catch_handler(handler, ExecutionContext::new(guard.lease.clone())).await;
        guard.phase = Phase::Recording(self.effect_happened(&result));
        let pending = match &result {
            Ok(Ok(value)) => Pending::Complete(self.engine.result_bytes(&self.codec, value)),
            _ => Pending::Release,
        };
        // Dropping the guard in the recording phase finishes in the background.
        guard.phase = Phase::Recording(pending);
        drop(guard);
        match result {
            Ok(Ok(value)) => Ok(Outcome::Unprotected(value)),
            Ok(Err(err)) => Err(ExecuteError::Handler(err.into_inner())),
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }

    /// What to record should recording this result fail half way (a panicking
    /// `Serialize` or codec): a success without its cached result, or a
    /// release for a failure.
    pub(super) fn effect_happened<T, E>(
        &self,
        result: &Result<Result<T, HandlerError<E>>, Panic>,
    ) -> Pending {
        match result {
            Ok(Ok(_)) => Pending::Complete(None),
            _ => Pending::Release,
        }
    }

    /// The write that records a handler's result.
    pub(super) fn pending_for<T: Serialize, E: fmt::Display>(
        &self,
        result: &Result<Result<T, HandlerError<E>>, Panic>,
    ) -> Pending {
        let (kind, message) = match result {
            Ok(Ok(value)) => {
                return Pending::Complete(self.engine.result_bytes(&self.codec, value))
            }
            Ok(Err(err)) => (err.kind(), err.to_string()),
            Err(panic) => (
                FailureKind::Default,
                format!("handler panicked: {}", panic_message(panic)),
            ),
        };
        let engine = &self.engine;
        match failure_record(&engine.config, engine.caps.max_result_bytes, kind, message) {
            FailureRecord::Release => Pending::Release,
            FailureRecord::Store { error, retryable } => Pending::Fail { error, retryable },
        }
    }

    pub(super) fn success_outcome<T>(&self, finished: Finished, value: T) -> Outcome<T> {
        match finished {
            Finished::Applied => {
                record_outcome("executed");
                Outcome::Executed(value)
            }
            Finished::LeaseLost => {
                self.engine.metrics.count(Counter::LeaseLost);
                record_outcome("lease_lost");
                tracing::warn!("handler finished after its lease was taken over");
                Outcome::LeaseLost(value)
            }
            Finished::Failed(error) => {
                tracing::error!(error = %error, "handler succeeded but its completion was not recorded before the lease ended");
                record_outcome("unrecorded");
                Outcome::Unrecorded { value, error }
            }
        }
    }

    /// The answer of a delivery whose reservation found a live record: the
    /// execution ends here, its guard with it.
    pub(super) fn answer_reserved_duplicate<T, E>(
        &self,
        mut guard: ExecutionGuard,
        decision: DuplicateDecision,
        unsettled: bool,
    ) -> Result<Outcome<T>, ExecuteError<E>>
    where
        T: DeserializeOwned,
    {
        // An unanswered attempt may have created a record under our token:
        // the guard (left in the reserving phase) releases it.
        if !unsettled {
            guard.phase = Phase::Done;
        }
        let lease = guard.lease.clone();
        drop(guard);
        self.engine.metrics.count(Counter::DuplicatesBlocked);
        self.answer_duplicate(&lease.key, decision)
    }

    pub(super) fn answer_duplicate<T, E>(
        &self,
        key: &RecordKey,
        decision: DuplicateDecision,
    ) -> Result<Outcome<T>, ExecuteError<E>>
    where
        T: DeserializeOwned,
    {
        let (outcome, counter) = match &decision {
            DuplicateDecision::Replay(_) => ("cached", Some(Counter::CacheHits)),
            DuplicateDecision::Duplicate => ("duplicate", None),
            DuplicateDecision::PayloadMismatch => ("payload_mismatch", None),
            DuplicateDecision::PreviouslyFailed(_) => ("previously_failed", None),
            DuplicateDecision::InProgress { .. } => ("in_progress", None),
        };
        if let Some(counter) = counter {
            self.engine.metrics.count(counter);
        }
        record_outcome(outcome);
        let decision = match decision {
            DuplicateDecision::InProgress { retry_after } => DuplicateDecision::InProgress {
                retry_after: self.engine.hold_time.hint(retry_after),
            },
            other => other,
        };
        answer_duplicate(&self.codec, key, decision)
    }
}

/// Runs the handler, catching a panic in its call or its future.
async fn catch_handler<T, E, F, Fut>(
    handler: F,
    ctx: ExecutionContext,
) -> Result<Result<T, HandlerError<E>>, Panic>
where
    F: FnOnce(ExecutionContext) -> Fut,
    Fut: Future<Output = Result<T, HandlerError<E>>>,
{
    match std::panic::catch_unwind(AssertUnwindSafe(|| handler(ctx))) {
        Ok(fut) => AssertUnwindSafe(fut).catch_unwind().await,
        Err(panic) => Err(panic),
    }
}

/// Logs how recording a handler's failure ended.
fn report_failure_record(engine: &Engine, finished: &Finished, pending: &Phase) {
    let op = match pending {
        Phase::Recording(Pending::Release) => "release",
        _ => "fail",
    };
    match finished {
        Finished::Applied => {}
        Finished::LeaseLost => engine.metrics.count(Counter::LeaseLost),
        Finished::Failed(e) => {
            tracing::error!(error = %e, operation = op, "could not record the handler failure; the record stays Processing until its lease ends");
        }
    }
}

fn panic_message(panic: &Panic) -> &str {
    panic
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| panic.downcast_ref::<&str>().copied())
        .unwrap_or("non-string panic")
}
