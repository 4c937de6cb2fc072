"""Tool calling on top of the model: parsing the assistant's tool calls and routing tools with the
contrastive and confidence heads."""
