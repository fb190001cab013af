//! The protobuf codec of the ledger's services: prost's encoding, except that a message that
//! cannot be decoded (a string field holding invalid UTF-8, a truncated field) is the sender's
//! mistake — `INVALID_ARGUMENT` with reason `MALFORMED_REQUEST` — rather than an `INTERNAL`
//! error of the receiver.

use std::marker::PhantomData;

use crate::refusal::Refusal;
use prost::Message;
use tonic::codec::{BufferSettings, DecodeBuf, Decoder};
use tonic::{Code, Status};

/// Named by the generated clients and servers (`codec_path` in `build.rs`).
#[derive(Debug, Clone)]
pub struct Codec<T, U> {
    _types: PhantomData<(T, U)>,
}

impl<T, U> Default for Codec<T, U> {
    fn default() -> Self {
        Self {
            _types: PhantomData,
        }
    }
}

impl<T, U> tonic::codec::Codec for Codec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = tonic_prost::ProstEncoder<T>;
    type Decoder = MessageDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        tonic_prost::ProstEncoder::default()
    }

    fn decoder(&mut self) -> Self::Decoder {
        MessageDecoder { _type: PhantomData }
    }
}

/// Decodes one message, blaming the sender for bytes that are not one.
#[derive(Debug, Clone)]
pub struct MessageDecoder<U> {
    _type: PhantomData<U>,
}

impl<U: Message + Default> Decoder for MessageDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        U::decode(buf).map(Some).map_err(|error| malformed(&error))
    }

    fn buffer_settings(&self) -> BufferSettings {
        BufferSettings::default()
    }
}

/// `INVALID_ARGUMENT` for a message that is not valid protobuf. prost's description names the
/// message and field it stopped at (`BeginRequest.tool: invalid string value: …`).
fn malformed(error: &prost::DecodeError) -> Status {
    Refusal::new(
        Code::InvalidArgument,
        "MALFORMED_REQUEST",
        format!("the message cannot be decoded: {error}"),
    )
    .into_status()
}
