"""SAS: one encoder with MLM and RTD heads; SAS^DA adds DeBERTa's disentangled attention."""
