//! Consumer middleware: a handler wrapper and a dispatcher for event streams.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use serde_json::Value;

use crate::codec::JsonCodec;
use crate::error::Error;
use crate::manager::{ExecuteError, HandlerError, IdempotencyManager, Outcome};
use crate::strategy::{Event, KeyStrategy};

/// A boxed, sendable future.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// An event handler: the unit the dispatcher wraps. Implemented for async closures
/// `Fn(Event) -> Future<Output = Result<Value, HandlerError<String>>>`.
pub trait EventHandler: Send + Sync + 'static {
    /// Handles one event.
    fn handle(&self, event: Event) -> BoxFuture<'static, Result<Value, HandlerError<String>>>;
}

impl<F, Fut> EventHandler for F
where
    F: Fn(Event) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Value, HandlerError<String>>> + Send + 'static,
{
    fn handle(&self, event: Event) -> BoxFuture<'static, Result<Value, HandlerError<String>>> {
        Box::pin(self(event))
    }
}

/// A handler wrapped so each event (by the key strategy) is handled once.
///
/// ```
/// use std::sync::Arc;
/// use idempotency_core::{Config, Event, HandlerError, IdempotencyManager, IdempotentHandler, KeyStrategy, MemoryRepository};
/// use serde_json::{json, Value};
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(async {
/// let manager = IdempotencyManager::new(Arc::new(MemoryRepository::new()), Config::default())?;
/// let handler = IdempotentHandler::new(manager, "ship-order", KeyStrategy::EventBased, |e: Event| async move {
///     Ok::<Value, HandlerError<String>>(json!({"shipped": e.payload["order"]}))
/// })?;
/// let event = Event::new("OrderPaid", "evt-1", json!({"order": 7}));
/// assert!(handler.handle(event.clone()).await?.handler_ran());
/// assert!(handler.handle(event).await?.is_duplicate());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # })?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct IdempotentHandler {
    name: String,
    manager: IdempotencyManager<JsonCodec>,
    strategy: KeyStrategy,
    handler: Arc<dyn EventHandler>,
}

impl fmt::Debug for IdempotentHandler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotentHandler")
            .field("name", &self.name)
            .field("namespace", &self.manager.namespace())
            .field("strategy", &self.strategy)
            .finish()
    }
}

impl IdempotentHandler {
    /// Wraps `handler`; its records live in the scope `name` of the manager's
    /// namespace, so two handlers of one event each run once.
    ///
    /// # Errors
    /// [`Error::InvalidKey`](crate::Error::InvalidKey) when `name` makes the
    /// namespace too long (see [`IdempotencyManager::scoped`]).
    pub fn new(
        manager: IdempotencyManager<JsonCodec>,
        name: impl Into<String>,
        strategy: KeyStrategy,
        handler: impl EventHandler,
    ) -> Result<Self, crate::Error> {
        let name = name.into();
        Ok(IdempotentHandler {
            manager: manager.scoped(&name)?,
            name,
            strategy,
            handler: Arc::new(handler),
        })
    }

    /// The handler's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Handles `event` once per key; duplicates get the recorded outcome.
    ///
    /// # Errors
    /// As [`IdempotencyManager::execute`]; the key strategy's errors as
    /// [`ExecuteError::Idempotency`].
    pub async fn handle(&self, event: Event) -> Result<Outcome<Value>, ExecuteError<String>> {
        let key = self.strategy.key_for(&event)?;
        let handler = self.handler.clone();
        let payload = event.payload.clone();
        self.manager
            .execute(&key, &payload, move || handler.handle(event))
            .await
    }
}

/// Routes events to every handler registered for their type, each wrapped in an
/// [`IdempotentHandler`].
///
/// ```
/// use std::sync::Arc;
/// use idempotency_core::{Config, Dispatcher, Event, HandlerError, IdempotencyManager, KeyStrategy, MemoryRepository};
/// use serde_json::{json, Value};
///
/// # tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(async {
/// let manager = IdempotencyManager::new(Arc::new(MemoryRepository::new()), Config::default())?;
/// let mut dispatcher = Dispatcher::new(manager, KeyStrategy::EventBased);
/// dispatcher.register("OrderPaid", "ship", |_e: Event| async { Ok::<Value, HandlerError<String>>(json!("shipped")) })?;
/// dispatcher.register("OrderPaid", "email", |_e: Event| async { Ok::<Value, HandlerError<String>>(json!("sent")) })?;
/// let event = Event::new("OrderPaid", "evt-1", json!({}));
/// let first = dispatcher.dispatch(event.clone()).await;
/// let again = dispatcher.dispatch(event).await;
/// assert_eq!(first.len(), 2);
/// assert!(first.iter().all(|(_, r)| r.as_ref().is_ok_and(|o| o.handler_ran())));
/// assert!(again.iter().all(|(_, r)| r.as_ref().is_ok_and(|o| o.is_duplicate())));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # })?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Dispatcher {
    manager: IdempotencyManager<JsonCodec>,
    strategy: KeyStrategy,
    handlers: HashMap<String, Vec<IdempotentHandler>>,
}

impl fmt::Debug for Dispatcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Dispatcher")
            .field("strategy", &self.strategy)
            .field("handlers", &self.handlers)
            .finish()
    }
}

/// What [`Dispatcher::dispatch`] returns per handler: its name and result.
pub type DispatchResult = (String, Result<Outcome<Value>, ExecuteError<String>>);

impl Dispatcher {
    /// A dispatcher using `strategy` for every handler (override per handler with
    /// [`Dispatcher::register_with`]).
    pub fn new(manager: IdempotencyManager<JsonCodec>, strategy: KeyStrategy) -> Self {
        Dispatcher {
            manager,
            strategy,
            handlers: HashMap::new(),
        }
    }

    /// Registers `handler` under `name` for events of `event_type`.
    ///
    /// # Errors
    /// As [`IdempotentHandler::new`].
    pub fn register(
        &mut self,
        event_type: impl Into<String>,
        name: impl Into<String>,
        handler: impl EventHandler,
    ) -> Result<&mut Self, crate::Error> {
        let strategy = self.strategy.clone();
        self.register_with(event_type, name, strategy, handler)
    }

    /// Registers `handler` with its own key strategy.
    ///
    /// # Errors
    /// As [`IdempotentHandler::new`].
    pub fn register_with(
        &mut self,
        event_type: impl Into<String>,
        name: impl Into<String>,
        strategy: KeyStrategy,
        handler: impl EventHandler,
    ) -> Result<&mut Self, crate::Error> {
        let wrapped = IdempotentHandler::new(self.manager.clone(), name, strategy, handler)?;
        self.handlers
            .entry(event_type.into())
            .or_default()
            .push(wrapped);
        Ok(self)
    }

    /// Runs every handler registered for the event's type, concurrently; returns
    /// each handler's name and result (empty when none is registered).
    pub async fn dispatch(&self, event: Event) -> Vec<DispatchResult> {
        let Some(handlers) = self.handlers.get(&event.event_type) else {
            return Vec::new();
        };
        let runs = handlers.iter().map(|h| {
            let event = event.clone();
            async move { (h.name().to_owned(), h.handle(event).await) }
        });
        futures::future::join_all(runs).await
    }

    /// The event types with at least one handler.
    pub fn event_types(&self) -> impl Iterator<Item = &str> {
        self.handlers.keys().map(String::as_str)
    }
}

impl From<Error> for HandlerError<String> {
    fn from(e: Error) -> Self {
        HandlerError::new(e.to_string())
    }
}
