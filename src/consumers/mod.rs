//! Who is reading which queue: broker events and management snapshots combined into one live
//! view per broker, shared by the gate and `queueguard consumers`.

pub mod events;
pub mod output;
pub mod pool;
pub mod registry;
pub mod tracker;

pub use pool::TrackerPool;
pub use registry::{Change, Consumer, QueueKey};
pub use tracker::{ConsumerTracker, Tracking};
